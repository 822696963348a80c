# Sourced by testbed/build-image.sh and testbed/build-guest.sh.
# copy_modules KROOT ROOTFS MODULE...: copies MODULEs of the kernel package unpacked in KROOT,
# with their dependencies, into ROOTFS/lib/modules and lists them in load order in
# ROOTFS/lib/modules/order (modprobe resolves the order from a depmod run on the package).
copy_modules() {
    local kroot="$1" rootfs="$2" kver m
    shift 2
    kver="$(ls "$kroot/lib/modules" | head -n 1)"
    depmod -b "$kroot" "$kver"
    mkdir -p "$rootfs/lib/modules"
    : > "$rootfs/lib/modules/order"
    for m in "$@"; do
        modprobe -d "$kroot" -S "$kver" --show-depends "$m" | while read -r kind path _; do
            [[ "$kind" == insmod ]] || continue
            name="$(basename "$path")"
            grep -qx "$name" "$rootfs/lib/modules/order" && continue
            cp "$path" "$rootfs/lib/modules/$name"
            echo "$name" >> "$rootfs/lib/modules/order"
        done
    done
}
