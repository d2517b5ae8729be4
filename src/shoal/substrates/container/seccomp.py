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
