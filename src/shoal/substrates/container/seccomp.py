"""The default seccomp profile: allow by default, refuse (EPERM) what a sandbox never needs.

A denylist rather than an allowlist so that arbitrary images and toolchains keep working; every entry
below is a syscall that reaches the kernel's or host's shared state (mounts, modules, keys, BPF, perf,
clocks, reboot, io_uring) or another process's memory or file descriptors. Two are refused by argument:
`clone` with any namespace flag (so no new user namespace, whose capabilities open most of the kernel),
and `ptrace` attaching to a running process (PTRACE_ATTACH/SEIZE); a child may still ask to be traced
(PTRACE_TRACEME), so debuggers that start their target work. `clone3` answers ENOSYS, so libc falls back
to `clone`, whose flags a filter can read.
"""

from __future__ import annotations

import base64
import ctypes
import ctypes.util
import tempfile
from functools import cache
from typing import Any

DENIED_SYSCALLS = [
    "acct", "add_key", "bpf", "clock_adjtime", "clock_settime", "create_module", "delete_module",
    "finit_module", "fsconfig", "fsmount", "fsopen", "fspick", "get_kernel_syms", "get_mempolicy",
    "init_module", "ioperm", "iopl", "kcmp", "kexec_file_load", "kexec_load", "keyctl", "lookup_dcookie",
    "mbind", "mount", "mount_setattr", "move_mount", "move_pages", "name_to_handle_at", "nfsservctl",
    "open_by_handle_at", "open_tree", "perf_event_open", "pivot_root", "process_vm_readv",
    "process_vm_writev", "query_module", "quotactl", "quotactl_fd", "reboot", "request_key",
    "set_mempolicy", "setns", "settimeofday", "stime", "swapoff", "swapon", "syslog", "umount",
    "umount2", "unshare", "uselib", "userfaultfd", "ustat", "vhangup", "vm86", "vm86old", "_sysctl",
    "fanotify_init", "adjtimex", "pidfd_getfd", "process_madvise", "io_uring_setup", "io_uring_enter",
    "io_uring_register",
]  # fmt: skip

EPERM = 1
ENOSYS = 38
CLONE_NAMESPACE_FLAGS = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}
PTRACE_ATTACH = 16
PTRACE_SEIZE = 0x4206


@cache
def seccomp_profile() -> dict[str, Any]:
    refuse = {"action": "SCMP_ACT_ERRNO", "errnoRet": EPERM}
    rules: list[dict[str, Any]] = [{"names": DENIED_SYSCALLS, **refuse}]
    for flag in CLONE_NAMESPACE_FLAGS.values():  # one rule per bit: the rules are ORed, a rule's args ANDed
        arg = {"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}
        rules.append({"names": ["clone"], "args": [arg], **refuse})
    for request in (PTRACE_ATTACH, PTRACE_SEIZE):
        rules.append({"names": ["ptrace"], "args": [{"index": 0, "value": request, "op": "SCMP_CMP_EQ"}], **refuse})
    rules.append({"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS})
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        "syscalls": rules,
    }


SIGNAL_SYSCALLS = ["kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "pidfd_open"]


@cache
def gvisor_profile() -> dict[str, Any]:
    """runsc's profile (applied by gVisor with --oci-seccomp): only what gVisor itself does not cover.

    Linux shields a PID namespace's init from signals sent inside it unless it handles them; gVisor does
    not, so `kill -KILL 1` (or TERM, SEGV...) from a command took the agent and the sandbox with it. Every
    syscall that names a process by number is refused for PID 1 (the low 32 bits: the kernel reads a pid
    as an int); the agent ignores catchable signals too. The rest of `seccomp_profile` is not applied:
    there gVisor's own kernel is the boundary (and this gVisor ignores errnoRet, so clone3 would get EPERM).
    """
    pid1 = {"index": 0, "value": 0xFFFFFFFF, "valueTwo": 1, "op": "SCMP_CMP_MASKED_EQ"}
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        "syscalls": [{"names": SIGNAL_SYSCALLS, "args": [pid1], "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM}],
    }


class _ArgCmp(ctypes.Structure):  # libseccomp's struct scmp_arg_cmp
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]


_OPS = {"SCMP_CMP_NE": 1, "SCMP_CMP_LT": 2, "SCMP_CMP_LE": 3, "SCMP_CMP_EQ": 4, "SCMP_CMP_GE": 5, "SCMP_CMP_GT": 6,
        "SCMP_CMP_MASKED_EQ": 7}  # fmt: skip
_ARCHES = {"SCMP_ARCH_X86_64": 0xC000003E, "SCMP_ARCH_X86": 0x40000003, "SCMP_ARCH_X32": 0x4000003E}
_EEXIST = 17
_FLTATR_CTL_OPTIMIZE = 8  # enum scmp_filter_attr; 2 = syscalls in a binary tree


def _action(name: str, errno_ret: int | None) -> int:
    if name == "SCMP_ACT_ALLOW":
        return 0x7FFF0000
    if name == "SCMP_ACT_ERRNO":
        return 0x00050000 | ((EPERM if errno_ret is None else errno_ret) & 0xFFFF)
    raise ValueError(f"no BPF for seccomp action {name}")


def compile_bpf(profile: dict[str, Any], optimize: bool = True) -> bytes:
    """The BPF program libseccomp makes of an OCI seccomp `profile`: crun's calls in crun's order, with the
    syscall numbers in a binary tree instead of crun's linear list (libseccomp's SCMP_FLTATR_CTL_OPTIMIZE=2).
    Every syscall gets the same answer as from crun's filter (tests/test_launch.py runs both programs over
    every syscall number of every architecture). Why (issue 12): loading a filter makes the kernel run it once
    per syscall number and architecture to build its cache of always-allowed syscalls (seccomp_cache_prepare,
    with interrupts off), a walk of the whole list for each of ~1,400 numbers when the list is linear: the
    filter's load took 0.45 ms here, on every create's critical path, 0.16 ms as a tree. `optimize=False`:
    crun's own layout."""
    try:  # the soname crun itself links (no `ldconfig -p` run, as find_library does)
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError:
        lib = ctypes.CDLL(ctypes.util.find_library("seccomp") or "libseccomp.so")
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_arch_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_ArgCmp)
    ]  # fmt: skip
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(_action(profile["defaultAction"], None))
    if not ctx:
        raise OSError("libseccomp could not make a filter")
    try:
        if optimize:  # a libseccomp before 2.5 refuses: its linear list, as crun's
            lib.seccomp_attr_set(ctx, _FLTATR_CTL_OPTIMIZE, 2)
        for arch in profile["architectures"]:
            if lib.seccomp_arch_add(ctx, _ARCHES[arch]) not in (0, -_EEXIST):  # the native one is there already
                raise OSError(f"libseccomp refused architecture {arch}")
        for rule in profile["syscalls"]:
            args = rule.get("args", [])
            cmps = (_ArgCmp * max(1, len(args)))(
                *[_ArgCmp(a["index"], _OPS[a["op"]], a["value"], a.get("valueTwo", 0)) for a in args]
            )
            action = _action(rule["action"], rule.get("errnoRet"))
            for name in rule["names"]:
                number = lib.seccomp_syscall_resolve_name(name.encode())
                if number == -1:  # unknown to this libseccomp: crun skips it too
                    continue
                if lib.seccomp_rule_add_array(ctx, action, number, len(args), cmps) != 0:
                    raise OSError(f"libseccomp refused the rule for {name}")
        with tempfile.TemporaryFile() as out:
            if lib.seccomp_export_bpf(ctx, out.fileno()) != 0:
                raise OSError("libseccomp could not export the filter")
            out.seek(0)
            return out.read()
    finally:
        lib.seccomp_release(ctx)


@cache
def seccomp_bpf_base64() -> str | None:
    """seccomp_profile() compiled once per node, for crun's `run.oci.seccomp_bpf_data` annotation (crun then
    loads it instead of compiling the profile on every create: ~0.5 of ~7 CPU-ms of a `crun run -d`).
    None where libseccomp is missing or refuses: the bundle's profile is applied as before."""
    try:
        return base64.b64encode(compile_bpf(seccomp_profile())).decode()
    except (OSError, ValueError, AttributeError):
        return None
