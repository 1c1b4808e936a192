"""The inside of one local container: builds its root filesystem in a private mount namespace, enters
it, under the pod's hostname, and executes the container's command. Run by `ContainerRun`
(harness.cluster) as the first process of new mount, UTS and PID namespaces (`unshare --mount --uts
--pid --fork`), as root.

The root holds only what a pod on a cluster would see: the host's system directories standing in for
the image's operating system (read-only), the image's own files (the project and its Python,
read-only, where the image has them), the pod's volumes at their mount paths, a fresh /tmp and /proc,
/etc/hostname, and /etc/hosts: a link to `hosts` in the pod's DNS directory, bound read-only at
/run/cluster-dns, where the cluster replaces the file whole as pods come and go (its DNS).
Everything else of this machine (other work trees, caches, test directories) is absent, so a
path that the pod reads without mounting it fails there as it would on a cluster. The command runs as
the container's user (its image's USER, or its securityContext), with that user's passwd entry and home
directory: what it may write on a volume is what the volume's owner and modes allow that user.

    python -m harness.container SPEC.json
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

SYSTEM_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr")
DNS_DIR = "/run/cluster-dns"


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def _bind(source: str, target: Path, read_only: bool, recursive: bool = False) -> None:
    if Path(source).is_dir():
        target.mkdir(parents=True, exist_ok=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch()
    _mount("--rbind" if recursive else "--bind", source, str(target))
    if read_only:
        _mount("-o", "remount,bind,ro", str(target))


def _system(root: Path) -> None:
    """The operating system of the image: this machine's, read-only; /etc is copy-on-write."""
    for name in SYSTEM_DIRS:
        host = Path("/") / name
        if host.is_symlink():
            (root / name).symlink_to(os.readlink(host))
        elif host.is_dir():
            _bind(str(host), root / name, read_only=True)
    layers = root / ".layers" / "etc"
    (layers / "upper").mkdir(parents=True)
    (layers / "work").mkdir()
    (root / "etc").mkdir()
    _mount(
        "-t",
        "overlay",
        "overlay",
        "-o",
        f"lowerdir=/etc,upperdir={layers / 'upper'},workdir={layers / 'work'}",
        str(root / "etc"),
    )
    _bind("/dev", root / "dev", read_only=False, recursive=True)
    _bind("/sys", root / "sys", read_only=True, recursive=True)
    (root / "proc").mkdir()
    _mount("-t", "proc", "proc", str(root / "proc"))
    (root / "tmp").mkdir(mode=0o1777)
    _mount("-t", "tmpfs", "-o", "mode=1777", "tmpfs", str(root / "tmp"))


def _names(root: Path, hostname: str, dns: str) -> None:
    """The pod's hostname (this UTS namespace's), /etc/hostname, and /etc/hosts from the pod's DNS
    directory."""
    socket.sethostname(hostname)
    (root / "etc" / "hostname").write_text(hostname + "\n")
    _bind(dns, root / DNS_DIR.lstrip("/"), read_only=True)
    hosts = root / "etc" / "hosts"
    hosts.unlink(missing_ok=True)
    hosts.symlink_to(f"{DNS_DIR}/hosts")


def _image(root: Path, files: dict[str, str], masked: list[str]) -> None:
    for inside, host in files.items():
        _bind(host, root / inside.lstrip("/"), read_only=True)
    for path in masked:  # inside the image's paths but not part of the image (caches of this machine)
        inside_root = root / path.lstrip("/")
        if inside_root.is_dir():
            _mount("-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(inside_root))


def _volumes(root: Path, mounts: list[dict]) -> None:
    for mount in mounts:
        target = root / mount["target"].lstrip("/")
        if mount.get("tmpfs"):
            target.mkdir(parents=True, exist_ok=True)
            size = f",size={mount['size']}" if mount.get("size") else ""
            _mount("-t", "tmpfs", "-o", f"mode=1777{size}", "tmpfs", str(target))
        else:
            _bind(mount["source"], target, read_only=mount["read_only"])


def _user(root: Path, user: dict) -> None:
    """The image's user as the image has it: its /etc/passwd entry and its home directory, owned by it."""
    passwd = root / "etc" / "passwd"
    entries = passwd.read_text()
    if not any(line.split(":")[2:3] == [str(user["uid"])] for line in entries.splitlines()):
        passwd.write_text(f"{entries}{user['name']}:x:{user['uid']}:{user['gid']}::{user['home']}:/bin/sh\n")
    home = root / user["home"].lstrip("/")
    if user["home"] != "/" and not home.exists():
        home.mkdir(parents=True)
        os.chown(home, user["uid"], user["gid"])


def _become(user: dict) -> None:
    """Drop root for the container's user: its supplementary groups, its group, then its uid."""
    os.setgroups(user["groups"])
    os.setgid(user["gid"])
    os.setuid(user["uid"])


def enter(spec: dict) -> None:
    root = Path(spec["rootfs"])
    root.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "tmpfs", str(root))
    _system(root)
    _names(root, spec["hostname"], spec["dns"])
    _image(root, spec["image_files"], spec["masked"])
    _volumes(root, spec["mounts"])
    _user(root, spec["user"])
    os.chroot(root)
    os.chdir(spec["workdir"])
    _become(spec["user"])
    _default_signals()
    os.execvpe(spec["argv"][0], spec["argv"], spec["env"])


def _default_signals() -> None:
    """A container runtime starts the container's process with every signal at its default disposition.
    Ignored signals survive exec, and a shell that starts this cluster as a background job ignores SIGINT and
    SIGQUIT (nohup: SIGHUP too); a shell started ignoring SIGINT cannot trap it (POSIX), so the xcom
    sidecar's `trap "exit 0" INT` would never end it. Reset them, as the runtime would."""
    for number in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(number, signal.SIG_DFL)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    try:
        enter(spec)
    except (OSError, subprocess.CalledProcessError) as err:
        print(f"container {spec.get('name')}: cannot start: {err}", file=sys.stderr, flush=True)
        sys.exit(128)


if __name__ == "__main__":
    main()
