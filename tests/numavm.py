"""A throw-away multi-NUMA Linux guest that runs one command on this machine's own root.

Real kernel NUMA nodes give the VM tests what no fake can: numactl, libnuma and the
kernel's page placement, counted per node. QEMU builds the nodes (its ACPI SRAT) and
boots Debian's stock kernel with a small busybox initramfs; the guest mounts this
machine's ``/`` read-only over virtio-9p under a RAM overlay (writes are thrown away),
so the repo, its ``.venv`` and ``numactl`` are there at their own paths. The command
runs as root in the caller's directory with the caller's environment and an empty
stdin; its output streams back through a private 9p share. The CPUs are emulated (TCG),
which works on any host QEMU runs on, even where KVM boots no stock kernel; Python there
is about twenty times slower than here.

    python tests/numavm.py [--nodes N] [--cpus C] [--mem-mb M] [--pci-node NODE[:MODEL]]
                           [--timeout S] -- COMMAND [ARG ...]

exits with the command's status (124 past the deadline). Run as root, the first use
installs the Debian packages the guest needs (qemu-system-x86, busybox-static) and,
where no kernel is installed, unpacks Debian's current one (linux-image-amd64's) into
``.venv/numavm-kernel`` without installing it, which would build an initramfs for this
machine (minutes); without them the VM tests skip, naming them.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import pytest

PACKAGES = {
    "qemu-system-x86": "qemu-system-x86_64, its firmware and virtio-9p",
    "busybox-static": "a static /bin/busybox for the guest's first process",
    "linux-image-amd64": "a guest kernel with its modules",
}
# Without an installed kernel, Debian's current one is unpacked here (not installed:
# installing a kernel builds an initramfs for this machine, which takes minutes).
KERNEL_CACHE = Path(__file__).resolve().parents[1] / ".venv" / "numavm-kernel"
REPO = Path(__file__).resolve().parents[1]
BUSYBOX = Path("/bin/busybox")
# Loaded in this order (each after what it needs) before the guest can see its root.
GUEST_MODULES = ("virtio_pci", "9pnet_virtio", "9p", "overlay")
NINEP = "trans=virtio,version=9p2000.L,msize=262144"
# PID 1: this machine's / read-only under a RAM overlay, the job, its status, power off.
# Any failure before the job ends the guest (panic=-1, -no-reboot) with no status.
INIT = f"""#!/bin/busybox sh
set -e
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for module in $(cat /modules); do insmod "/lib/$module"; done
mount -t 9p -o {NINEP} job /job
mount -t 9p -o {NINEP},ro,cache=loose root /lower
mount -t tmpfs -o mode=0755 tmpfs /upper
mkdir /upper/u /upper/w
mount -t overlay -o lowerdir=/lower,upperdir=/upper/u,workdir=/upper/w overlay /root
cd /root
mount -t proc proc proc
mount -t sysfs sysfs sys
mount -t devtmpfs devtmpfs dev
mkdir -p dev/pts dev/shm
mount -t devpts devpts dev/pts
mount -t tmpfs -o mode=1777 tmpfs dev/shm
mount -t tmpfs -o mode=0755 tmpfs run
ip link set lo up
status=0
chroot /root "$(cat /job/python)" -I -S -c "$(cat /job/launch.py)" \\
    </job/job.json >/job/stdout 2>/job/stderr || status=$?
echo "$status" >/job/status
poweroff -f
"""
# Run in the guest's root by this machine's own Python: the job arrives as JSON on
# stdin, so no value is ever written into shell code.
LAUNCH = """import json, os, sys
job = json.load(sys.stdin)
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
os.chdir(job["cwd"])
os.execvpe(job["argv"][0], job["argv"], job["env"])
"""


class VmUnavailable(RuntimeError):
    """What this machine lacks to boot the VM, and how to get it."""


@dataclass(frozen=True)
class Shape:
    """The guest's topology: node i holds CPUs [i*C/N, (i+1)*C/N), a socket each."""

    nodes: int = 2
    cpus: int = 4
    mem_mb: int = 2048
    pci_nodes: tuple[tuple[int, str], ...] = ()  # (node, QEMU device model) per device


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2, metavar="N", help="1 to 64")
    p.add_argument("--cpus", type=int, default=4, metavar="C", help="N to 256")
    p.add_argument("--mem-mb", type=int, default=2048, metavar="M", help="to 65536")
    p.add_argument(
        "--pci-node",
        action="append",
        default=[],
        metavar="NODE[:MODEL]",
        help="a PCIe device on NODE (default virtio-rng-pci) behind an expander bridge",
    )
    p.add_argument("--timeout", type=int, default=600, metavar="S")
    p.add_argument("command", nargs=argparse.REMAINDER)
    return p


def shape_from(args: argparse.Namespace) -> Shape:
    if not (
        1 <= args.nodes <= 64
        and args.nodes <= args.cpus <= 256
        and 128 * args.nodes <= args.mem_mb <= 65536
        and args.cpus % args.nodes == 0
    ):
        raise ValueError(
            f"--nodes {args.nodes} --cpus {args.cpus} --mem-mb {args.mem_mb}: give "
            "1 to 64 nodes the same number of CPUs each (256 in all at most) and "
            "128 MiB to 64 GiB of memory, at least 128 MiB a node"
        )
    pci = []
    for spec in args.pci_node:
        node, _, model = spec.partition(":")
        if not node.isdigit() or int(node) >= args.nodes:
            raise ValueError(f"--pci-node {spec!r}: no such node (0-{args.nodes - 1})")
        pci.append((int(node), model or "virtio-rng-pci"))
    return Shape(args.nodes, args.cpus, args.mem_mb, tuple(pci))


def is_static(path: Path) -> bool:
    """An ELF executable with no PT_INTERP program header needs no shared library."""
    try:
        elf = path.read_bytes()
    except OSError:
        return False
    if elf[:5] != b"\x7fELF\x02":
        return False
    phoff = int.from_bytes(elf[32:40], "little")
    size, count = (int.from_bytes(elf[i : i + 2], "little") for i in (54, 56))
    headers = (elf[phoff + i * size : phoff + i * size + 4] for i in range(count))
    return all(int.from_bytes(h, "little") != 3 for h in headers)


def guest_kernel() -> Optional[tuple[Path, Path]]:
    """The newest installed /boot/vmlinuz-V with its /lib/modules/V, else the one
    unpacked into KERNEL_CACHE."""

    def version(kernel: Path) -> list:
        return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", kernel.name)]

    for root in (Path("/"), KERNEL_CACHE):
        kernels = sorted((root / "boot").glob("vmlinuz-*"), key=version, reverse=True)
        for kernel in kernels:
            modules = root / "lib/modules" / kernel.name.removeprefix("vmlinuz-")
            if (modules / "modules.dep").is_file() and os.access(kernel, os.R_OK):
                return kernel, modules
    return None


def missing_packages() -> list[str]:
    have = {
        "qemu-system-x86": shutil.which("qemu-system-x86_64") is not None,
        "busybox-static": is_static(BUSYBOX),
        "linux-image-amd64": guest_kernel() is not None,
    }
    return [name for name, present in have.items() if not present]


def _module_name(path: str) -> str:
    return re.sub(r"\.ko(\.xz)?$", "", os.path.basename(path)).replace("-", "_")


def _module_depends(data: bytes) -> list[str]:
    """The modules a module's ``.modinfo`` says it depends on."""
    if data[:6] == b"\xfd7zXZ\x00":
        data = lzma.decompress(data)
    found = re.search(rb"\x00depends=([^\x00]*)\x00", data)
    return [_module_name(n) for n in found[1].decode().split(",") if n] if found else []


def unpack_kernel(deb: Path, into: Path) -> None:
    """The kernel image of the package ``deb`` and the modules GUEST_MODULES need, under
    ``into`` (boot/vmlinuz-V, lib/modules/V/kernel/..., and their modules.dep)."""
    tarball = subprocess.Popen(
        ["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE
    )
    kernels: dict[str, bytes] = {}
    modules: dict[str, tuple[str, bytes]] = {}  # name -> (path under V, data)
    with tarfile.open(fileobj=tarball.stdout, mode="r|") as tar:
        for member in tar:
            name = member.name.removeprefix("./")
            if not member.isfile():
                continue
            if re.fullmatch(r"boot/vmlinuz-[^/]+", name):
                kernels[name] = tar.extractfile(member).read()
            elif re.fullmatch(r"lib/modules/[^/]+/kernel/.+\.ko(\.xz)?", name):
                modules[_module_name(name)] = (name, tar.extractfile(member).read())
    if tarball.wait() != 0 or len(kernels) != 1:
        raise VmUnavailable(f"{deb.name}: no single kernel image in it")
    ((kernel, image),) = kernels.items()
    version = kernel.removeprefix("boot/vmlinuz-")
    needed, deps = list(GUEST_MODULES), {}
    while needed:
        name = needed.pop()
        if name in deps or name not in modules:  # done, or built into the kernel
            continue
        deps[name] = [d for d in _module_depends(modules[name][1]) if d in modules]
        needed.extend(deps[name])
    order: list[str] = []  # a load order: each module after what it needs

    def load(name: str) -> None:
        if name not in order:
            for dep in deps[name]:
                load(dep)
            order.append(name)

    for name in deps:
        load(name)

    def closure(name: str) -> set[str]:
        return set(deps[name]).union(*(closure(d) for d in deps[name]))

    tree = into / "lib/modules" / version
    paths = {n: modules[n][0].removeprefix(f"lib/modules/{version}/") for n in deps}
    lines = []
    for name in order:
        (tree / paths[name]).parent.mkdir(parents=True, exist_ok=True)
        (tree / paths[name]).write_bytes(modules[name][1])
        # As depmod writes it: every module it needs, the one to load first last.
        needs = [paths[d] for d in reversed(order) if d in closure(name)]
        lines.append(f"{paths[name]}: {' '.join(needs)}".rstrip())
    (tree / "modules.dep").write_text("\n".join(lines) + "\n")
    (into / "boot").mkdir(parents=True)
    (into / kernel).write_bytes(image)


def fetch_kernel() -> None:
    """Debian's current kernel (linux-image-amd64's) unpacked into KERNEL_CACHE."""
    depends = subprocess.run(
        ["apt-cache", "depends", "linux-image-amd64"], capture_output=True, text=True
    ).stdout
    found = re.search(r"Depends: (linux-image-\S+)", depends)
    if found is None:
        raise VmUnavailable("apt knows no linux-image-amd64: `apt-get update` first")
    KERNEL_CACHE.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=KERNEL_CACHE.parent) as tmp:
        download = subprocess.run(
            ["apt-get", "-qq", "download", found[1]], cwd=tmp, capture_output=True
        )
        debs = list(Path(tmp).glob("*.deb"))
        if download.returncode != 0 or len(debs) != 1:
            error = download.stderr.decode(errors="replace").strip()[-300:]
            raise VmUnavailable(f"`apt-get download {found[1]}` failed: {error}")
        unpack_kernel(debs[0], Path(tmp) / "kernel")
        try:
            os.rename(Path(tmp) / "kernel", KERNEL_CACHE)
        except OSError as e:
            raise VmUnavailable(
                f"{KERNEL_CACHE} holds no usable kernel and cannot be replaced ({e}): "
                "remove it"
            )


@functools.cache
def ensure_packages() -> None:
    """Install what the guest needs from Debian as root (the kernel is only unpacked,
    into KERNEL_CACHE); else say what is missing."""
    missing = missing_packages()
    if not missing:
        return
    what = "; ".join(f"{name} ({PACKAGES[name]})" for name in missing)
    fix = f"apt-get install --no-install-recommends {' '.join(missing)}"
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise VmUnavailable(
            f"the multi-NUMA VM needs Debian packages: {what}; run the VM tests "
            f"as root once, or `sudo {fix}`"
        )
    print(f"numavm: installing {' '.join(missing)}", file=sys.stderr, flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    apt = ["apt-get", "-qq", "-o", "DPkg::Lock::Timeout=600"]
    install = [name for name in missing if name != "linux-image-amd64"]
    steps = [["update"]]
    if install:
        steps.append(["install", "-y", "--no-install-recommends", *install])
    for step in steps:
        done = subprocess.run(
            apt + step, env=env, stdin=subprocess.DEVNULL, capture_output=True
        )
        if done.returncode != 0:
            raise VmUnavailable(
                f"the multi-NUMA VM needs {what}; `apt-get {' '.join(step)}` failed "
                f"({done.stderr.decode(errors='replace').strip()[-300:]}): `{fix}`"
            )
    if "linux-image-amd64" in missing:
        fetch_kernel()
    if missing_packages():
        raise VmUnavailable(f"installed {' '.join(missing)}, still missing {what}")


def require_vm() -> None:
    """For scripts: exit with one line naming what is missing to boot the VM here."""
    try:
        ensure_packages()
    except VmUnavailable as missing:
        raise SystemExit(f"numavm: {missing}")


def newc(entries: Iterable[tuple[str, int, bytes, int]]) -> bytes:
    """A cpio archive in the initramfs format, of (name, mode, data, device) entries."""
    out = bytearray()
    trailer = ("TRAILER!!!", 0, b"", 0)
    for ino, (name, mode, data, device) in enumerate([*entries, trailer], 1):
        path = name.encode() + b"\0"
        fields = (ino, mode, 0, 0, 1, 0, len(data), 0, 0, device >> 8, device & 255)
        out += b"070701" + b"".join(b"%08X" % f for f in (*fields, len(path), 0))
        out += path + bytes(-(110 + len(path)) % 4) + data + bytes(-len(data) % 4)
    return bytes(out)


def module_files(modules: Path) -> list[Path]:
    """GUEST_MODULES and what they need, each after its dependencies."""
    deps = {}
    for line in (modules / "modules.dep").read_text().splitlines():
        target, _, needs = line.partition(":")
        deps[re.sub(r"\.ko(\.xz)?$", "", Path(target).name)] = [target, *needs.split()]
    order: list[str] = []
    for name in GUEST_MODULES:
        if name in deps:  # else built into this kernel
            target, *needs = deps[name]
            for file in [*reversed(needs), target]:
                if file not in order:
                    order.append(file)
    return [modules / file for file in order]


def initramfs(modules: Path) -> bytes:
    entries = [(d, 0o40755, b"", 0) for d in ("bin", "dev", "lib", "proc", "sys")]
    entries += [(d, 0o40755, b"", 0) for d in ("job", "lower", "upper", "root")]
    entries.append(("dev/console", 0o20600, b"", 5 << 8 | 1))
    entries.append(("bin/busybox", 0o100755, BUSYBOX.read_bytes(), 0))
    names = []
    for path in module_files(modules):
        data = path.read_bytes()
        if path.suffix == ".xz":
            data, path = lzma.decompress(data), path.with_suffix("")
        entries.append((f"lib/{path.name}", 0o100644, data, 0))
        names.append(path.name)
    entries.append(("modules", 0o100644, "\n".join(names).encode(), 0))
    entries.append(("init", 0o100755, INIT.encode(), 0))
    return newc(entries)


def qemu_opt(value: object) -> str:
    """A value inside a QEMU option list, where a comma must be doubled."""
    return str(value).replace(",", ",,")


def qemu_argv(shape: Shape, *, kernel: Path, work: Path) -> list[str]:
    per_node, mem_mb = shape.cpus // shape.nodes, shape.mem_mb // shape.nodes
    argv = ["qemu-system-x86_64", "-machine", "q35", "-accel", "tcg,thread=multi"]
    argv += ["-cpu", "max", "-m", f"{mem_mb * shape.nodes}M", "-smp"]
    argv += [f"{shape.cpus},sockets={shape.nodes},cores={per_node},threads=1"]
    for node in range(shape.nodes):
        cpus = f"{node * per_node}-{(node + 1) * per_node - 1}"
        argv += ["-object", f"memory-backend-ram,id=mem{node},size={mem_mb}M"]
        argv += ["-numa", f"node,nodeid={node},cpus={cpus},memdev=mem{node}"]
    for i, (node, model) in enumerate(shape.pci_nodes):
        bridge = f"id=pxb{i},bus=pcie.0,bus_nr={128 + 16 * i},numa_node={node}"
        port = f"id=port{i},bus=pxb{i},chassis={i + 1},slot=0"
        argv += ["-device", f"pxb-pcie,{bridge}", "-device", f"pcie-root-port,{port}"]
        argv += ["-device", f"{qemu_opt(model)},bus=port{i}"]
    for tag, path, extra in (("root", Path("/"), ",readonly=on"), ("job", work, "")):
        fsdev = f"id={tag},path={qemu_opt(path)},security_model=none{extra}"
        argv += ["-fsdev", f"local,{fsdev},multidevs=remap", "-device"]
        argv += [f"virtio-9p-pci,bus=pcie.0,fsdev={tag},mount_tag={tag}"]
    argv += ["-nodefaults", "-no-user-config", "-display", "none", "-no-reboot"]
    argv += ["-chardev", f"file,id=console,path={qemu_opt(work / 'console.log')}"]
    argv += ["-serial", "chardev:console", "-kernel", str(kernel), "-initrd"]
    argv += [str(work / "initramfs"), "-append", "console=ttyS0 quiet panic=-1"]
    return argv


def follow(
    qemu: subprocess.Popen, paths: Sequence[Path], *, deadline: float, echo: bool
) -> list[str]:
    """What the guest writes to ``paths`` (stdout, stderr) until QEMU exits, as text."""
    sinks = (sys.stdout.buffer, sys.stderr.buffer) if echo else (None, None)
    outputs = [bytearray() for _ in paths]
    with contextlib.ExitStack() as stack:
        readers = [stack.enter_context(open(p, "rb", buffering=0)) for p in paths]
        while True:
            exited = qemu.poll() is not None
            for reader, output, sink in zip(readers, outputs, sinks):
                chunk = reader.read() or b""
                output += chunk
                if sink and chunk:
                    sink.write(chunk)
                    sink.flush()
            if exited or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    texts = [output.decode(errors="replace") for output in outputs]
    if not exited:
        raise subprocess.TimeoutExpired(qemu.args, 0, *texts)
    return texts


def run(
    argv: Sequence[str], *, shape: Shape, timeout_s: float, echo: bool = False
) -> subprocess.CompletedProcess:
    """Boot a VM of ``shape``, run ``argv`` in it, and return its status and output.

    ``echo`` copies the output here as it arrives. Past ``timeout_s`` (boot included)
    the VM is killed and ``subprocess.TimeoutExpired`` carries what had come back.
    """
    ensure_packages()
    kernel, modules = guest_kernel()
    deadline = time.monotonic() + timeout_s
    with tempfile.TemporaryDirectory(prefix="numavm-") as tmp:
        work = Path(tmp)
        (work / "initramfs").write_bytes(initramfs(modules))
        (work / "python").write_text(sys.executable)
        (work / "launch.py").write_text(LAUNCH)
        job = {"argv": list(argv), "cwd": os.getcwd(), "env": dict(os.environ)}
        (work / "job.json").write_text(json.dumps(job))
        streams = [work / "stdout", work / "stderr"]
        for path in streams:
            path.touch()
        with open(work / "qemu.log", "wb") as log, subprocess.Popen(
            qemu_argv(shape, kernel=kernel, work=work),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        ) as qemu:
            try:
                out, err = follow(qemu, streams, deadline=deadline, echo=echo)
            except subprocess.TimeoutExpired as late:
                raise subprocess.TimeoutExpired(
                    argv, timeout_s, late.output, late.stderr
                ) from None
            finally:
                qemu.kill()
        status = work / "status"
        if not (status.exists() and status.read_text().strip().isdigit()):
            tails = (
                (work / name).read_text(errors="replace")[-3000:]
                for name in ("qemu.log", "console.log")
            )
            raise RuntimeError(
                f"the VM stopped before the command ended (qemu exit "
                f"{qemu.returncode})\n" + "\n".join(tails)
            )
        return subprocess.CompletedProcess(
            list(argv), int(status.read_text()), out, err
        )


def run_script_in_vm(
    script: str, *script_args: str, vm_args: Sequence[str], vm_timeout_s: int
) -> dict:
    """Run ``python script script_args`` (``script`` relative to the repo) in a VM
    shaped by ``vm_args`` (this module's flags); return its last stdout line as JSON.
    Skips the calling test when this machine cannot boot the VM."""
    shape = shape_from(parser().parse_args([*vm_args]))
    try:
        ensure_packages()
    except VmUnavailable as missing:
        pytest.skip(str(missing))
    argv = [sys.executable, str(REPO / script), *script_args]
    try:
        done = run(argv, shape=shape, timeout_s=vm_timeout_s)
    except subprocess.TimeoutExpired as late:
        done = subprocess.CompletedProcess(argv, None, late.output, late.stderr)
    if done.returncode != 0:
        raise AssertionError(
            f"{script} in the VM: exit status {done.returncode} (None: past "
            f"{vm_timeout_s} s)\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    cli = parser()
    args = cli.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or not 0 < args.timeout <= 86400:
        cli.error("give -- COMMAND [ARG ...], and --timeout from 1 to 86400 s")
    try:
        shape = shape_from(args)
    except ValueError as error:
        cli.error(str(error))
    require_vm()
    try:
        done = run(command, shape=shape, timeout_s=args.timeout, echo=True)
    except RuntimeError as error:
        raise SystemExit(f"numavm: {error}")
    except subprocess.TimeoutExpired:
        print(f"numavm: past {args.timeout} s; the VM was killed", file=sys.stderr)
        raise SystemExit(124)
    raise SystemExit(done.returncode)


if __name__ == "__main__":
    main()
