#!/usr/bin/env python3
"""Packs a directory into a newc cpio archive (what the kernel's initramfs loader reads).

Usage: mkcpio.py DIR OUT. Owners are root, modes and symlinks are kept, files are sorted so the
archive is reproducible. Replaces a dependency on the cpio tool."""
import os
import stat
import sys


def header(name, mode, size, ino, nlink=1):
    fields = [ino, mode, 0, 0, nlink, 0, size, 0, 0, 0, 0, len(name) + 1, 0]
    return ("070701" + "".join(f"{v:08x}" for v in fields)).encode()


def pad(n):
    return b"\0" * ((4 - n % 4) % 4)


def main(src, out):
    ino = 1
    with open(out, "wb") as f:
        for dirpath, dirnames, filenames in os.walk(src):
            dirnames.sort()
            # A directory is written when os.walk enters it, before its files.
            for name in [""] + sorted(filenames):
                path = os.path.join(dirpath, name) if name else dirpath
                rel = os.path.relpath(path, src)
                if rel == ".":
                    continue
                st = os.lstat(path)
                if stat.S_ISLNK(st.st_mode):
                    data = os.readlink(path).encode()
                elif stat.S_ISREG(st.st_mode):
                    data = open(path, "rb").read()
                else:
                    data = b""
                arc = rel.encode()
                h = header(arc, st.st_mode, len(data), ino) + arc + b"\0"
                f.write(h + pad(len(h)) + data + pad(len(data)))
                ino += 1
        t = header(b"TRAILER!!!", 0, 0, 0) + b"TRAILER!!!\0"
        f.write(t + pad(len(t)))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
