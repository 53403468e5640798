"""OS-level containment of one sandboxed process, set up in the child between fork and exec: a PID
namespace of its own (our PID 1 in it, the program PID 2), private mount, network and IPC
namespaces, a minimal read-only root holding only the interpreter, its libraries and a tmpfs
working folder, and a seccomp filter on the system calls that reach past all of that. Linux only;
every step needs root except the filter. Knows nothing of programs, tests or the protocol between
them: that is `lockstep.evaluate.sandbox`."""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import resource
import select
import signal
import struct
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable

WORKDIR = "/sandbox"  # where the program's working folder appears inside its root
# tmpfs inodes cost kernel memory that no rlimit counts: a program creating empty files forever
# would otherwise grow it without bound.
MAX_FILES = 4096

_CLONE_NEWNS, _CLONE_NEWIPC, _CLONE_NEWPID, _CLONE_NEWNET = 0x00020000, 0x08000000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 1 << 14, 1 << 18
_MNT_DETACH = 2
_PR_SET_PDEATHSIG, _PR_SET_SECCOMP, _PR_SET_NO_NEW_PRIVS, _SECCOMP_MODE_FILTER = 1, 22, 38, 2

# What the program's root holds of the host besides the interpreter and its own lib folder: the
# shared-library folders the dynamic linker searches (top-level ones that are symlinks, as on
# merged-/usr systems, are recreated as the same symlinks), the linker's cache, and the harmless
# character devices. Not /proc (no process is visible), not /etc, /tmp, /home or the project.
_LIBRARY_DIRS = ("/lib", "/lib32", "/lib64", "/libx32", "/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/libx32",
                 "/usr/local/lib")
_HOST_FILES = ("/etc/ld.so.cache",)
_DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.unshare.argtypes = [ctypes.c_int]
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return libc


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: bytes | None, target: str, fstype: bytes | None, flags: int, data: bytes | None = None) -> None:
    _check(_libc().mount(source, os.fsencode(target), fstype, flags, data), f"mount {target}")


# ---------------------------------------------------------------------------------------------
# The minimal root.

@functools.cache
def root_entries(interpreter: str) -> tuple[tuple[str, str, str], ...]:
    """What the program's root holds of the host, as (kind, path, link target) with kind one of
    dir, file, device (bound read-only at the same path) or link (recreated), parents first.
    `interpreter` is the real path of the Python that is exec'd; its prefix's lib folder (stdlib,
    extension modules, libpython) comes with it."""
    # The stdlib is where `os` came from (in a virtual environment sysconfig names the venv's folder).
    wanted = [*_LIBRARY_DIRS, *_HOST_FILES, interpreter, os.path.dirname(os.__file__),
              *{os.path.join(p, "lib") for p in (sys.base_prefix, sys.base_exec_prefix)},
              sysconfig.get_config_var("LIBDIR") or ""]
    entries: dict[str, tuple[str, str, str]] = {}
    for path in wanted:
        if not path or not os.path.lexists(path):
            continue
        if os.path.islink(path) and path in _LIBRARY_DIRS:
            entries[path] = ("link", path, os.readlink(path))
            wanted.append(os.path.realpath(path))
            continue
        real = os.path.realpath(path)
        entries[real] = ("dir" if os.path.isdir(real) else "file", real, "")
    for path in _DEVICES:
        if os.path.exists(path):
            entries[path] = ("device", path, "")
    bound_dirs = [p for p, (kind, _, _) in entries.items() if kind == "dir"]
    # A path inside a bound folder comes with it.
    kept = [e for p, e in entries.items() if not any(p != d and p.startswith(d.rstrip("/") + "/") for d in bound_dirs)]
    return tuple(sorted(kept, key=lambda e: e[1]))


def _build_root(
    root_dir: str, disk_bytes: int, owner: tuple[int, int], entries: tuple[tuple[str, str, str], ...]
) -> None:
    """Make `root_dir` this mount namespace's root: a small read-only tmpfs holding `entries` bound
    read-only, and at WORKDIR a tmpfs of `disk_bytes` owned by `owner`, the one writable place.
    The host's root is unmounted afterwards, so no path leads back to it."""
    os.umask(0o022)
    # Private first, so nothing below propagates back to the host's mounts.
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    _mount(b"tmpfs", root_dir, b"tmpfs", _MS_NOSUID | _MS_NODEV, b"size=1m,nr_inodes=1024,mode=0755")
    for kind, path, target in entries:
        inside = root_dir + path
        os.makedirs(os.path.dirname(inside), exist_ok=True)
        if kind == "link":
            os.symlink(target, inside)
            continue
        if kind == "dir":
            os.mkdir(inside)
        else:
            os.close(os.open(inside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        _mount(os.fsencode(path), inside, None, _MS_BIND)
        # Devices need device access and no exec; folders and files the reverse.
        extra = _MS_NOEXEC if kind == "device" else _MS_NODEV
        _mount(None, inside, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | extra)
    os.mkdir(root_dir + WORKDIR)
    opts = f"size={disk_bytes},nr_inodes={MAX_FILES},mode=0700,uid={owner[0]},gid={owner[1]}".encode()
    _mount(b"tmpfs", root_dir + WORKDIR, b"tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, opts)
    old = "/.host"
    os.mkdir(root_dir + old)
    _check(_libc().syscall(_SYSCALLS[_machine()][1]["pivot_root"], os.fsencode(root_dir), os.fsencode(root_dir + old)),
           "pivot_root")
    os.chdir("/")
    _check(_libc().umount2(old.encode(), _MNT_DETACH), "unmount the host's root")
    os.rmdir(old)
    _mount(None, "/", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)


# ---------------------------------------------------------------------------------------------
# The PID namespace. Three processes: the waiter (outside, the harness's child), the namespace's
# PID 1 (ours: it reaps, and when it ends the kernel kills everything left in the namespace), and
# the program, PID 2. All three start in the group the harness kills at the deadline; the program
# might leave the group, PID 1 never does, so that kill always ends the program too.

def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent ends (PR_SET_PDEATHSIG), and end it
    now if that parent, `parent_pid`, already has. Each sandboxed process runs in a session of its
    own, so nothing else delivers its harness's death (an OOM kill, `timeout`, a cancelled CI job):
    without it a sleeping program, and the waiter and PID 1 beside it, outlived the harness for
    good. The signal follows the thread that forked this process, which for a sandbox is the
    harness's thread blocked in `run_python`/`run_tests` until the sandbox is over."""
    _set_death_signal()
    if os.getppid() != parent_pid:
        os._exit(1)


def _set_death_signal() -> None:
    _check(_libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")


def _close_all_but(*keep: int) -> None:
    # Hold nothing of the harness's: its pipes must see end-of-file when the program ends.
    last = 3
    for fd in sorted(keep):
        os.closerange(last, fd)
        last = fd + 1
    os.closerange(last, resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def _reap(program: int, status_w: int) -> None:
    """PID 1: reap every process until the program ends, send its wait status to the waiter, and
    exit, which ends the namespace. Never returns."""
    _close_all_but(status_w)
    while True:
        pid, status = os.wait()
        if pid == program:
            break
    os.write(status_w, struct.pack("=i", status))
    os._exit(0)


def _relay(init: int, status_r: int) -> None:
    """The waiter: end the way the program ended (PID 1, which cannot die of its own signal, sends
    the program's wait status through a pipe). Never returns."""
    _close_all_but(status_r)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _, status = os.waitpid(init, 0)
    sent = os.read(status_r, 4)
    if len(sent) == 4:
        status = struct.unpack("=i", sent)[0]
    if os.WIFEXITED(status):
        os._exit(os.WEXITSTATUS(status))
    sig = os.WTERMSIG(status)
    if sig not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)


def contain(root_dir: str, disk_bytes: int, owner: tuple[int, int], interpreter: str) -> None:
    """In a child between fork and exec, as root: become the waiter of a new PID namespace whose
    PID 1 builds the program's private mount, network and IPC namespaces and its minimal root
    (`root_dir`, with WORKDIR a tmpfs of `disk_bytes` owned by `owner`), then forks the program.
    Returns only in the program's process (PID 2, in WORKDIR); the other two never return. PID 1
    dies with the waiter, and the namespace with it; the waiter dies with its parent where the
    caller has set that up (`die_with_parent`)."""
    libc = _libc()
    _check(libc.unshare(_CLONE_NEWPID), "unshare(PID namespace)")
    status_r, status_w = os.pipe()
    init = os.fork()
    if init:
        _relay(init, status_r)
    os.close(status_r)
    # PID 1 ends with the waiter (and the kernel then ends the program, PID 2). Its parent is in
    # another PID namespace, so getppid() says 0 whatever happened: the waiter is gone exactly when
    # the status pipe has no reader left.
    _set_death_signal()
    poller = select.poll()
    poller.register(status_w, select.POLLOUT)
    if any(events & select.POLLERR for _, events in poller.poll(0)):
        os._exit(1)
    _check(libc.unshare(_CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWIPC), "unshare(mount, network, IPC namespaces)")
    _build_root(root_dir, disk_bytes, owner, root_entries(interpreter))
    program = os.fork()
    if program:
        _reap(program, status_w)
    os.close(status_w)
    os.chdir(WORKDIR)


# ---------------------------------------------------------------------------------------------
# The syscall filter (seccomp-bpf): refused calls fail with EPERM.

# Refused outright, each for what it reaches past the other limits:
_DENIED = (
    # memory no rlimit counts: anonymous files, SysV segments and queues that outlive a mapping
    "memfd_create", "memfd_secret", "shmget", "msgget", "semget",
    # sockets and special files: without namespaces, a pathname unix socket (/dev/log) is reachable
    # by connect or sendto, and a socketpair's datagram end does both as well as a socket would
    "socket", "socketpair", "mknod", "mknodat",
    # new namespaces (a user namespace would let the program mount a tmpfs without a cap) and mounts
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsmount", "fsconfig",
    "fspick", "open_tree", "move_mount", "mount_setattr",
    # leaving the process group the harness kills at the deadline
    "setsid", "setpgid",
    # io_uring runs operations (sockets included) that no filter sees; the rest is kernel surface
    # a test program has no use for
    "io_uring_setup", "bpf", "perf_event_open", "userfaultfd", "ptrace", "process_vm_readv",
    "process_vm_writev", "add_key", "request_key", "keyctl", "pidfd_open", "pidfd_send_signal",
)
# Allowed only with the process's own pid as the first argument: without a PID namespace,
# kill(-1, SIGKILL) reaches every process of the same uid.
_SELF_ONLY = ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")
# prctl(PR_SET_PDEATHSIG, sig) is allowed only with SIGKILL: without a PID namespace that signal
# is what ends the program with its harness, and clearing it would let a sleeping one outlive it.

# Per machine: the audit arch seccomp reports, and the syscall numbers (linux/unistd.h).
_SYSCALLS: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (0xC000003E, {
        "memfd_create": 319, "memfd_secret": 447, "shmget": 29, "msgget": 68, "semget": 64, "socket": 41,
        "socketpair": 53, "mknod": 133, "mknodat": 259, "unshare": 272, "setns": 308, "mount": 165, "umount2": 166,
        "pivot_root": 155, "chroot": 161, "fsopen": 430, "fsmount": 432, "fsconfig": 431, "fspick": 433,
        "open_tree": 428, "move_mount": 429, "mount_setattr": 442, "setsid": 112, "setpgid": 109,
        "io_uring_setup": 425, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "ptrace": 101,
        "process_vm_readv": 310, "process_vm_writev": 311, "add_key": 248, "request_key": 249, "keyctl": 250,
        "pidfd_open": 434, "pidfd_send_signal": 424, "kill": 62, "tkill": 200, "tgkill": 234,
        "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297, "prctl": 157,
    }),
    "aarch64": (0xC00000B7, {
        "memfd_create": 279, "memfd_secret": 447, "shmget": 194, "msgget": 186, "semget": 190, "socket": 198,
        "socketpair": 199, "mknodat": 33, "unshare": 97, "setns": 268, "mount": 40, "umount2": 39, "pivot_root": 41,
        "chroot": 51, "fsopen": 430, "fsmount": 432, "fsconfig": 431, "fspick": 433, "open_tree": 428,
        "move_mount": 429, "mount_setattr": 442, "setsid": 157, "setpgid": 154, "io_uring_setup": 425,
        "bpf": 280, "perf_event_open": 241, "userfaultfd": 282, "ptrace": 117, "process_vm_readv": 270,
        "process_vm_writev": 271, "add_key": 217, "request_key": 218, "keyctl": 219, "pidfd_open": 434,
        "pidfd_send_signal": 424, "kill": 129, "tkill": 130, "tgkill": 131, "rt_sigqueueinfo": 138,
        "rt_tgsigqueueinfo": 240, "prctl": 167,
    }),
}
_X32_SYSCALL_BIT = 0x40000000  # x86_64's x32 ABI numbers: refused whole, Python does not use them

_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_RET_ALLOW, _RET_KILL_PROCESS, _RET_EPERM = 0x7FFF0000, 0x80000000, 0x00050000 | 1
# struct seccomp_data: the call's number, its arch, and the low words of args 0 and 1 (little-endian)
_NR_OFFSET, _ARCH_OFFSET, _ARG0_OFFSET, _ARG1_OFFSET = 0, 4, 16, 24


def _machine() -> str:
    return platform.machine()


def filter_program(machine: str, own_pid: int) -> bytes:
    """The BPF program (struct sock_filter[]) for `machine`, allowing the signal calls only at
    `own_pid`."""
    audit_arch, numbers = _SYSCALLS[machine]
    code = [(_LD_W_ABS, 0, 0, _ARCH_OFFSET), (_JEQ_K, 1, 0, audit_arch), (_RET_K, 0, 0, _RET_KILL_PROCESS),
            (_LD_W_ABS, 0, 0, _NR_OFFSET)]
    if machine == "x86_64":
        code += [(_JGE_K, 0, 1, _X32_SYSCALL_BIT), (_RET_K, 0, 0, _RET_EPERM)]
    for name in _DENIED:
        if name in numbers:  # aarch64 has no mknod, only mknodat
            code += [(_JEQ_K, 0, 1, numbers[name]), (_RET_K, 0, 0, _RET_EPERM)]
    for name in _SELF_ONLY:
        code += [(_JEQ_K, 0, 4, numbers[name]), (_LD_W_ABS, 0, 0, _ARG0_OFFSET), (_JEQ_K, 0, 1, own_pid),
                 (_RET_K, 0, 0, _RET_ALLOW), (_RET_K, 0, 0, _RET_EPERM)]
    code += [(_JEQ_K, 0, 6, numbers["prctl"]), (_LD_W_ABS, 0, 0, _ARG0_OFFSET), (_JEQ_K, 0, 3, _PR_SET_PDEATHSIG),
             (_LD_W_ABS, 0, 0, _ARG1_OFFSET), (_JEQ_K, 1, 0, signal.SIGKILL), (_RET_K, 0, 0, _RET_EPERM),
             (_RET_K, 0, 0, _RET_ALLOW)]
    code.append((_RET_K, 0, 0, _RET_ALLOW))
    return b"".join(struct.pack("=HBBI", *insn) for insn in code)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install_filter() -> None:
    """Install the syscall filter on this process (kept across exec, inherited by nothing: the
    program may not fork). Sets no_new_privs first, as an unprivileged filter requires."""
    program = filter_program(_machine(), os.getpid())
    buf = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    libc = _libc()
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    _check(libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0), "prctl(PR_SET_SECCOMP)")


# ---------------------------------------------------------------------------------------------
# Probes: what this machine grants, found by doing it once in a throwaway child.

def _probe(setup: Callable[[], None], check: str, interpreter: str) -> str:
    """Run `interpreter -I -c check` with `setup` between fork and exec; '' when both succeed,
    else why not."""
    read_fd, write_fd = os.pipe()
    harness_pid = os.getpid()

    def attempt() -> None:
        try:
            die_with_parent(harness_pid)
            setup()
        except BaseException as e:
            os.write(write_fd, str(e).encode()[:4000])
            raise

    try:
        try:
            subprocess.run([interpreter, "-I", "-B", "-c", check], preexec_fn=attempt, pass_fds=(write_fd,),
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           timeout=30, check=True)
            failure = ""
        except subprocess.CalledProcessError as e:
            failure = f"{e}: {e.stderr.decode(errors='replace').strip().splitlines()[-1:]}"
        except (subprocess.SubprocessError, OSError) as e:
            failure = str(e)
        os.close(write_fd)
        write_fd = -1
        with os.fdopen(read_fd, "rb") as f:
            read_fd = -1
            return f.read().decode(errors="replace") or failure
    finally:
        for fd in (read_fd, write_fd):
            if fd >= 0:
                os.close(fd)


def probe_filter(interpreter: str) -> str:
    """'' when the syscall filter installs here and refuses what it should, else why not."""
    if _machine() not in _SYSCALLS:
        return f"no syscall table for machine {_machine()!r} (known: {', '.join(_SYSCALLS)})"
    check = ("import os\ntry:\n    os.memfd_create('probe')\nexcept PermissionError:\n    pass\nelse:\n"
             "    raise SystemExit('memfd_create was not refused')\n")
    return _probe(install_filter, check, interpreter)


def probe_namespaces(interpreter: str, imports: str, with_filter: bool,
                     dir_prefix: str = "lockstep-sandbox-probe-") -> str:
    """'' when a child can be contained here (namespaces, minimal root, `with_filter`) and the
    interpreter runs `imports` inside, else why not. The throwaway child's root is mounted on an
    empty temp folder named `dir_prefix`..., removed afterwards."""
    if os.geteuid() != 0:
        return "the harness does not run as root (namespaces and mounts need CAP_SYS_ADMIN)"
    if _machine() not in _SYSCALLS:
        return f"no pivot_root syscall number for machine {_machine()!r} (known: {', '.join(_SYSCALLS)})"
    root_dir = tempfile.mkdtemp(prefix=dir_prefix)

    def setup() -> None:
        contain(root_dir, 1 << 20, (os.geteuid(), os.getegid()), interpreter)
        if with_filter:
            install_filter()

    try:
        return _probe(setup, imports, interpreter)
    finally:
        os.rmdir(root_dir)
