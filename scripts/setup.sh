#!/usr/bin/env bash
# Installs what vmhost needs to build and test on Debian 12 (run as root; idempotent).
set -euo pipefail
pkgs=(pkg-config libhwloc-dev libudev-dev hwloc qemu-system-x86 acpica-tools kmod mtools dosfstools e2fsprogs)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
command -v cargo >/dev/null || { echo "setup: cargo not found: install a Rust toolchain (rustup)" >&2; exit 1; }
# `vmhost pod` output is validated against the official Kubernetes v1 JSON schemas
# (tests/cli_pod.rs) with kubernetes-validate, in a virtualenv under target/.
venv=target/k8s-venv
if [ ! -x "$venv/bin/kubernetes-validate" ]; then
  echo "setup: installing kubernetes-validate into $venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "kubernetes-validate==1.37.0"
fi
