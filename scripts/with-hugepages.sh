#!/usr/bin/env bash
# Runs a command with hugepages reserved for vmhost's tests, then restores the previous pool
# sizes, whatever the command's outcome.
#   VMHOST_TEST_HUGEPAGES_2M  2 MiB pages to have in the pool (default 512 = 1 GiB)
#   VMHOST_TEST_HUGEPAGES_1G  1 GiB pages to try to have (default 2; the kernel may grant fewer)
set -uo pipefail
want2m=${VMHOST_TEST_HUGEPAGES_2M:-512}
want1g=${VMHOST_TEST_HUGEPAGES_1G:-2}
f2m=/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages
f1g=/sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages
old2m=$(cat "$f2m"); old1g=$(cat "$f1g" 2>/dev/null || echo 0)
restore() {
  echo "$old2m" > "$f2m" 2>/dev/null || true
  [ -w "$f1g" ] && { echo "$old1g" > "$f1g" 2>/dev/null || true; }
}
trap restore EXIT
if [ "$old2m" -lt "$want2m" ]; then
  echo "$want2m" > "$f2m" || { echo "with-hugepages: cannot write $f2m (need root)" >&2; exit 1; }
fi
if [ -w "$f1g" ] && [ "$old1g" -lt "$want1g" ]; then
  echo "$want1g" > "$f1g" 2>/dev/null || true
fi
echo "with-hugepages: 2Mi pool $(cat "$f2m") (was $old2m), 1Gi pool $(cat "$f1g" 2>/dev/null || echo 0) (was $old1g)"
"$@"
