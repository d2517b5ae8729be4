"""The default seccomp profile: allow by default, refuse (EPERM) what a sandbox never needs.

A denylist rather than an allowlist so that arbitrary images and toolchains keep working; every entry
below is a syscall that reaches the kernel's or host's shared state (mounts, modules, keys, BPF, perf,
clocks, reboot) or another process's memory.
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
    "process_vm_writev", "ptrace", "query_module", "quotactl", "quotactl_fd", "reboot", "request_key",
    "set_mempolicy", "setns", "settimeofday", "stime", "swapoff", "swapon", "syslog", "umount",
    "umount2", "unshare", "uselib", "userfaultfd", "ustat", "vhangup", "vm86", "vm86old", "_sysctl",
    "fanotify_init", "adjtimex",
]  # fmt: skip

EPERM = 1


@cache
def seccomp_profile() -> dict[str, Any]:
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        "syscalls": [{"names": DENIED_SYSCALLS, "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM}],
    }
