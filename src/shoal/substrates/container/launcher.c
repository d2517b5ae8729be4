/* shoal-launcher: the `shoal` container runtime, pre-forked by the node (launcher.py).
 *
 * Why: a create through crun execs and dynamically links a runtime binary, parses config.json and
 * re-derives the same namespaces, mounts, cgroup limits, capabilities and seccomp filter every time. This
 * program is started once per node and makes each sandbox with the same isolation as the crun bundle that
 * oci.py describes, doing only the kernel's part per create.
 *
 * Protocol (a SOCK_SEQPACKET socketpair on fd 3; one message per request, NUL-separated "key=value" fields):
 *   node -> launcher: "op=init" with agent=, empty=<an empty directory>, nofile=, caps=<hex mask>, capmax=, bpf=<hex>, mask=<path>...,
 *                     ro=<path>..., cg=<hierarchy dir>..., dev=<devices.allow line>...
 *                     "op=create" with id=, rootfs=, overlay=, log=, pidfile=, cgroup=<relative path>, mem=, pids=,
 *                     shares=, quota=, period=, hostname=, tmpfs=<path>...; the agent's listening socket rides along
 *                     (SCM_RIGHTS) and becomes the sandbox's fd 3.
 *                     "op=destroy" with id=, pid=: SIGKILL that sandbox's init, reap it, remove its cgroup (or keep
 *                     it for a later sandbox, emptied under a spare's name: see keep_cgroup).
 *   launcher -> node: "<id> ok <pid>" once the agent has been exec'd, or "<id> err <reason>"; for a destroy
 *                     "<id> ok 0" once done, or "<id> gone 0" (not a sandbox of this launcher's).
 * The launcher exits when the node's end closes (the node stopped or died); sandboxes keep running.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define SOCK_FD 3
#define MAX_LIST 64
#define MAX_PENDING 256
#define MSG_MAX 65536

static struct {
    char agent[4096];
    char empty[4096]; /* an empty directory of the node's: masked directories are read-only binds of it */
    long nofile;
    int kept; /* at most this many closed sandboxes' cgroups kept (keep_cgroup; SHOAL_KEPT_CGROUPS) */
    uint64_t caps;
    int capmax;
    struct sock_filter *bpf;
    unsigned short bpf_len;
    char *mask[MAX_LIST], *ro[MAX_LIST], *cg[MAX_LIST], *dev[MAX_LIST];
    int nmask, nro, ncg, ndev;
    int ready;
} conf;

struct request {
    const char *id, *rootfs, *overlay, *log, *pidfile, *cgroup, *mem, *pids, *shares, *quota, *period, *hostname;
    const char *tmpfs[MAX_LIST];
    int ntmpfs;
};

struct pending {
    int fd; /* the child's status pipe: closes on exec, or carries the reason it failed */
    pid_t pid;
    char id[64];
};
static struct pending pending[MAX_PENDING];
static int npending;

/* The limits a request gives its cgroup: what a spare's cgroup was made with (see spare_cgroup), so that a
 * create writes only those that differ */
struct limits {
    char mem[32], pids[32], shares[32], quota[32], period[32];
};

/* The sandboxes this launcher made and has not reaped yet: their init's pid, cgroup and its limits; `destroy`
 * set once the node asked to destroy it (answered when it has been reaped and its cgroup removed or kept) */
struct sandbox {
    pid_t pid;
    char cgroup[512];
    char destroy[64];
    struct limits limits;
};
static struct sandbox *sandboxes;
static int nsandboxes, capsandboxes;

static struct sandbox *find_sandbox(pid_t pid) {
    for (int i = 0; i < nsandboxes; i++)
        if (sandboxes[i].pid == pid) return &sandboxes[i];
    return NULL;
}

static void reply(const char *fmt, ...) {
    char buf[8192];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if (n >= (int)sizeof buf) n = sizeof buf - 1;
    while (send(SOCK_FD, buf, n, MSG_NOSIGNAL) < 0 && errno == EINTR) {
    }
}

/* ------------------------------------------------------------------ the child: becomes the sandbox's init */

static int status_fd = -1;

static void fail(const char *what, const char *arg) {
    char buf[600];
    int n = snprintf(buf, sizeof buf, "%s %s: %s", what, arg ? arg : "", strerror(errno));
    if (n > 0) (void)!write(status_fd, buf, n > (int)sizeof buf ? (int)sizeof buf : n);
    _exit(127);
}

static void join(char *out, size_t size, const char *a, const char *b) {
    if ((size_t)snprintf(out, size, "%s%s", a, b) >= size) {
        errno = ENAMETOOLONG;
        fail("path", b);
    }
}

static void mount_or_fail(const char *src, const char *root, const char *dest, const char *type, unsigned long flags,
                          const char *data) {
    char target[4096];
    join(target, sizeof target, root, dest);
    if (mkdir(target, 0755) < 0 && errno != EEXIST) fail("mkdir", target);
    if (mount(src, target, type, flags, data) < 0) fail("mount", target);
}

static int empty_fd = -1; /* a detached read-only bind of conf.empty (child, until the first masked directory) */

static void mask_path(const char *root, const char *p) {
    char path[4096];
    struct stat st;
    join(path, sizeof path, root, p);
    if (lstat(path, &st) < 0) {
        if (errno == ENOENT) return; /* as crun: nothing to hide */
        fail("stat", path);
    }
    if (S_ISDIR(st.st_mode)) {
        /* one empty read-only directory for all of the sandbox's masked directories: a bind of the node's
         * empty directory (else one tmpfs), bound onto the others. Why (issue 12): every superblock on the
         * host has memcg-aware LRU lists, and removing a memory cgroup (each destroy) walks all of them
         * (memcg_reparent_list_lrus, under the cgroup mutex the next create's mkdir waits for: the largest
         * cost at 3,000 live sandboxes); a tmpfs per masked directory was 4 of a sandbox's 11 superblocks,
         * one tmpfs shared by them 1 of 8, a bind of an existing directory none */
        static char first[4096];
        if (first[0] && mount(first, path, NULL, MS_BIND, NULL) == 0) {
            if (mount(NULL, path, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY, NULL) < 0) fail("mask ro", path);
            return;
        }
        if (empty_fd >= 0) {
            if (move_mount(empty_fd, "", AT_FDCWD, path, MOVE_MOUNT_F_EMPTY_PATH) < 0) fail("mask", path);
            close(empty_fd);
            empty_fd = -1;
        } else if (mount("tmpfs", path, "tmpfs", MS_RDONLY, "size=0k") < 0) {
            fail("mask", path);
        }
        snprintf(first, sizeof first, "%s", path);
    } else {
        if (mount("/dev/null", path, NULL, MS_BIND, NULL) < 0) fail("mask", path);
        if (mount(NULL, path, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY, NULL) < 0) fail("mask ro", path);
    }
}

static void readonly_path(const char *root, const char *p) {
    char path[4096];
    join(path, sizeof path, root, p);
    if (mount(path, path, NULL, MS_BIND | MS_REC, NULL) < 0) {
        if (errno == ENOENT) return;
        fail("bind", path);
    }
    unsigned long flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC;
    if (mount(NULL, path, NULL, flags, NULL) < 0) fail("readonly", path);
}

static void mkdir_p(const char *path) {
    char at[4096];
    join(at, sizeof at, "", path);
    for (char *slash = strchr(at + 1, '/');; slash = strchr(slash + 1, '/')) {
        if (slash) *slash = 0;
        if (mkdir(at, 0755) < 0 && errno != EEXIST) fail("mkdir", at);
        if (!slash) return;
        *slash = '/';
    }
}

static int ahead_sysfs = -1; /* a spare's sysfs mount, made while it waited */
static int ahead_lo;          /* a spare's loopback, brought up while it waited */

#define HOSTNAME "sandbox" /* what a request names unless it says otherwise (fill_request): set ahead */

/* A new filesystem of `type`, as a detached mount (not in any namespace's tree until moved there): source
 * `source`, then `opts` as key/value pairs (a NULL value: a flag) up to a NULL key, mount attributes `attrs`.
 * The mount's fd, or -1 (errno set) */
static int detached_fs(const char *type, const char *source, const char *const *opts, unsigned attrs) {
    int fs = fsopen(type, FSOPEN_CLOEXEC), mnt = -1;
    if (fs < 0) return -1;
    int ok = fsconfig(fs, FSCONFIG_SET_STRING, "source", source, 0) == 0;
    for (; ok && opts && opts[0]; opts += 2)
        ok = (opts[1] ? fsconfig(fs, FSCONFIG_SET_STRING, opts[0], opts[1], 0)
                      : fsconfig(fs, FSCONFIG_SET_FLAG, opts[0], NULL, 0)) == 0;
    if (ok && fsconfig(fs, FSCONFIG_CMD_CREATE, NULL, NULL, 0) == 0) mnt = fsmount(fs, FSMOUNT_CLOEXEC, attrs);
    int saved = errno;
    close(fs);
    errno = saved;
    return mnt;
}

/* A detached private copy of the host's mount at `path` with `attr`; -1 (errno set) */
static int detached_bind(const char *path, struct mount_attr *attr) {
    int fd = open_tree(AT_FDCWD, path, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
    if (fd < 0) return -1;
    attr->propagation = MS_PRIVATE; /* not a peer of the host's mount, as a bind made in the sandbox's namespace */
    if (mount_setattr(fd, "", AT_EMPTY_PATH, attr, sizeof *attr) < 0) {
        int saved = errno;
        close(fd);
        errno = saved;
        return -1;
    }
    return fd;
}

/* What a sandbox's init does that needs no request, made by a spare while it waits (else at the start of a
 * child cloned on the spot). Why (issue 12): ~100 of the ~130 system calls between a create's request and the
 * agent's exec, ~45 of them mounts, each under the host's namespace lock; mqueue's mount also walks every
 * mqueue superblock on the host (one per sandbox) to find its IPC namespace's. The mounts are made detached
 * (fsopen/fsmount, open_tree) before the sandbox's mount namespace exists: /proc and /sys with oci.py's masks
 * and read-only binds mounted on them, /dev with its devpts, shm and mqueue; each tree is moved into the
 * sandbox's root after pivot_root with what is mounted on it (attach). Nothing of the host's is reachable from
 * them (/dev is a tmpfs of the sandbox's own, proc, sysfs and mqueue are its PID, network and IPC namespaces',
 * the agent's and the masks' binds are private copies). The capability bounding set is dropped here too: the
 * capabilities the steps below use stay effective until capset, and only an exec reads the bounding set.
 * NULL, or the step that failed (errno set) */
static struct {
    int agent, empty, proc, dev, pts, shm, mqueue;
} early = {-1, -1, -1, -1, -1, -1, -1};
static const char *const DEV_OPTS[] = {"mode", "755", "size", "65536k", NULL};
static const char *const PTS_OPTS[] = {"newinstance", NULL, "ptmxmode", "0666", "mode", "0620", NULL};
static const char *const SHM_OPTS[] = {"mode", "1777", "size", "65536k", NULL};
static const struct {
    const char *name;
    int major, minor;
} DEVICES[] = {{"null", 1, 3}, {"zero", 1, 5}, {"full", 1, 7}, {"random", 1, 8}, {"urandom", 1, 9}, {"tty", 5, 0}};
static const char *const LINKS[][2] = {{"pts/ptmx", "ptmx"}, {"/proc/self/fd", "fd"}, {"/proc/self/fd/0", "stdin"},
                                       {"/proc/self/fd/1", "stdout"}, {"/proc/self/fd/2", "stderr"},
                                       {"/proc/kcore", "core"}};

static int make_sysfs_ahead(void);
static char masked_early[MAX_LIST], readonly_early[MAX_LIST]; /* conf.mask[i] / conf.ro[i] done by prepare */

/* The detached tree that holds a sandbox path, and the path in it: /proc/... in its proc, /sys/... in its sysfs
 * (pivot_root leaves those paths as they are); -1 for a path elsewhere (done at the create) */
static int early_tree(const char *path, const char **rel) {
    if (!strncmp(path, "/proc/", 6) && path[6]) return *rel = path + 6, early.proc;
    if (!strncmp(path, "/sys/", 5) && path[5]) return *rel = path + 5, ahead_sysfs;
    return -1;
}

/* Move a new detached mount `fd` onto `rel` of detached tree `root` (and close it); -1 (errno set) */
static int mount_early(int fd, int root, const char *rel) {
    int done = move_mount(fd, "", root, rel, MOVE_MOUNT_F_EMPTY_PATH);
    int saved = errno;
    close(fd);
    errno = saved;
    return done;
}

/* Mask conf.mask[i] as mask_path does, on the detached trees: a file gets a read-only bind of the sandbox's
 * /dev/null, a directory a read-only bind of the node's empty directory (no superblock of its own); a path
 * that does not exist needs nothing. 1 done, 0 left for the create, -1 failed (errno set) */
static int mask_early(int i) {
    const char *rel;
    int root = early_tree(conf.mask[i], &rel);
    struct stat st;
    if (root < 0) return 0;
    if (fstatat(root, rel, &st, AT_SYMLINK_NOFOLLOW) < 0) return errno == ENOENT ? 1 : -1;
    if (S_ISDIR(st.st_mode)) { /* a copy of the masks' directory, with its flags: ro,relatime */
        if (early.empty < 0) return 0;
        int fd = open_tree(early.empty, "", OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_EMPTY_PATH);
        return fd < 0 || mount_early(fd, root, rel) < 0 ? -1 : 1;
    }
    int fd = open_tree(early.dev, "null", OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
    /* as the bind and read-only remount at the create make it: ro, nothing else (strictatime, as /dev's) */
    struct mount_attr ro = {.attr_set = MOUNT_ATTR_RDONLY, .attr_clr = MOUNT_ATTR_NOSUID};
    if (fd >= 0 && mount_setattr(fd, "", AT_EMPTY_PATH, &ro, sizeof ro) < 0) {
        close(fd);
        return -1;
    }
    return fd < 0 || mount_early(fd, root, rel) < 0 ? -1 : 1;
}

/* conf.ro[i] read-only as readonly_path makes it (a recursive bind onto itself, its top mount ro, nosuid,
 * nodev, noexec), on the detached trees; 1 done (or nothing there), 0 left for the create, -1 failed */
static int readonly_early_path(int i) {
    const char *rel;
    int root = early_tree(conf.ro[i], &rel);
    if (root < 0) return 0;
    int fd = open_tree(root, rel, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE);
    if (fd < 0) return errno == ENOENT ? 1 : -1;
    struct mount_attr ro = {.attr_set = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC};
    if (mount_setattr(fd, "", AT_EMPTY_PATH, &ro, sizeof ro) < 0) {
        close(fd);
        return -1;
    }
    return mount_early(fd, root, rel) < 0 ? -1 : 1;
}

/* The sysfs of a network namespace the launcher made with only its loopback (up), with oci.py's masks and
 * read-only paths under /sys on it (template_sysfs, made at init: make_template), cloned for each sandbox
 * instead of a sysfs mount of its own. Why (issue 12): a sysfs superblock is keyed to a network namespace, and
 * a new mount walks every sysfs superblock on the host to find out that it needs a new one (kernfs_test_super:
 * one per live sandbox, ~11 % of the machine at 3,000 live); a clone of a mount walks nothing, and the sandboxes
 * share one superblock instead of holding one each. What a sandbox sees is the same: sysfs shows only the
 * network devices of the namespace it was mounted in, and a sandbox's namespace has only its loopback (network
 * policies move a veth in: the node gives that sandbox a sysfs of its own first, own_sysfs), read-only,
 * nosuid, nodev, noexec, with the same masks. Its lo's counters are the template's (no traffic), not the
 * sandbox's. The template's network namespace is held by the launcher (template_net: a sysfs superblock holds
 * only a passive reference, which keeps no device) and ends with it; a restarted node gives the sandboxes it
 * re-adopts, and the node's next launcher those of one that died, a sysfs of their own (see own_sysfs). */
static int template_sysfs = -1, template_net = -1;
static char masked_template[MAX_LIST], readonly_template[MAX_LIST]; /* conf.mask[i] / conf.ro[i] on it */
static int sysfs_cloned; /* this spare's (or child's) ahead_sysfs is a clone of template_sysfs */

/* The sandbox's /sys, made ahead: a clone of the template with its masks (see there), else a sysfs mount of
 * the caller's network namespace; -1 (errno set) */
static int sysfs_ahead(void) {
    if (template_sysfs >= 0) { /* in a spare or a child: one clone, the template's fds closed after it */
        int fd = open_tree(template_sysfs, "", OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE | AT_EMPTY_PATH);
        close(template_sysfs);
        close(template_net);
        template_sysfs = template_net = -1;
        if (fd >= 0) {
            sysfs_cloned = 1;
            return fd;
        }
    }
    return make_sysfs_ahead();
}

static const char *prepare(void) {
    const unsigned hidden = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NOEXEC | MOUNT_ATTR_NODEV;
    if (setsid() < 0) return "setsid";
    /* the host's agent binary, attached at /.shoal/agent; the masks' empty directory, read-only as crun's
     * masking tmpfs (relatime: its options, whatever the node's filesystem has) */
    struct mount_attr agent = {.attr_set = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV};
    if ((early.agent = detached_bind(conf.agent, &agent)) < 0) return "agent bind";
    struct mount_attr ro = {.attr_set = MOUNT_ATTR_RDONLY | MOUNT_ATTR_RELATIME, .attr_clr = MOUNT_ATTR__ATIME};
    if (conf.empty[0] && (early.empty = detached_bind(conf.empty, &ro)) < 0) return "empty bind";
    /* as crun mounts them: proc, a /dev tmpfs with crun's devices and links, devpts, shm, mqueue */
    if ((early.proc = detached_fs("proc", "proc", NULL, hidden)) < 0) return "proc";
    if ((early.dev = detached_fs("tmpfs", "tmpfs", DEV_OPTS, MOUNT_ATTR_NOSUID | MOUNT_ATTR_STRICTATIME)) < 0)
        return "/dev";
    for (size_t i = 0; i < sizeof DEVICES / sizeof *DEVICES; i++) {
        if (mknodat(early.dev, DEVICES[i].name, S_IFCHR | 0666, makedev(DEVICES[i].major, DEVICES[i].minor)) < 0 ||
            fchmodat(early.dev, DEVICES[i].name, 0666, 0) < 0)
            return "mknod";
    }
    for (size_t i = 0; i < sizeof LINKS / sizeof *LINKS; i++)
        if (symlinkat(LINKS[i][0], early.dev, LINKS[i][1]) < 0) return "symlink";
    if (mkdirat(early.dev, "pts", 0755) < 0 || mkdirat(early.dev, "shm", 0755) < 0 ||
        mkdirat(early.dev, "mqueue", 0755) < 0)
        return "mkdir /dev";
    if ((early.pts = detached_fs("devpts", "devpts", PTS_OPTS, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NOEXEC)) < 0)
        return "devpts";
    if ((early.shm = detached_fs("tmpfs", "shm", SHM_OPTS, hidden)) < 0) return "shm";
    if ((early.mqueue = detached_fs("mqueue", "mqueue", NULL, hidden)) < 0) return "mqueue";
    if (ahead_sysfs < 0) ahead_sysfs = sysfs_ahead(); /* else mounted at the create, its masks there */
    /* masks first, as at the create; one that fails here (a kernel that mounts on no detached tree) is made
     * at the create, where a failure is reported; a clone of the template has the template's */
    for (int i = 0; i < conf.nmask; i++) masked_early[i] = (sysfs_cloned && masked_template[i]) || mask_early(i) > 0;
    for (int i = 0; i < conf.nro; i++)
        readonly_early[i] = (sysfs_cloned && readonly_template[i]) || readonly_early_path(i) > 0;
    if (sethostname(HOSTNAME, strlen(HOSTNAME)) < 0) return "sethostname";
    struct rlimit rl = {conf.nofile, conf.nofile};
    if (setrlimit(RLIMIT_NOFILE, &rl) < 0) return "setrlimit NOFILE";
    /* the agent outlives its sandbox's OOM kills; as the node does for crun, only where allowed (a host
     * without CAP_SYS_RESOURCE refuses it) */
    int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (fd >= 0) {
        (void)!write(fd, "-1000", 5);
        close(fd);
    }
    for (int cap = 0; cap <= conf.capmax; cap++)
        if (!(conf.caps & (1ULL << cap)) && prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0) return "drop capability";
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL) return "clear ambient";
    return NULL;
}

static int prepared;                /* prepare() ran (a spare: while it waited) */
static const char *prepare_failed; /* and what failed, reported at the create */
static int prepare_errno;

static void prepare_now(void) {
    prepare_failed = prepare();
    prepare_errno = errno;
    prepared = 1;
}

/* Attach a detached mount made ahead at `path` in the sandbox's tree (made if missing) */
static void attach(int *fd, const char *path) {
    if (move_mount(*fd, "", AT_FDCWD, path, MOVE_MOUNT_F_EMPTY_PATH) < 0) {
        if (errno != ENOENT || mkdir(path, 0755) < 0 ||
            move_mount(*fd, "", AT_FDCWD, path, MOVE_MOUNT_F_EMPTY_PATH) < 0)
            fail("move_mount", path);
    }
    close(*fd);
    *fd = -1;
}


/* The new network namespace's loopback up, as crun brings it up: localhost works inside (servers and their
 * clients in one sandbox, a kernel and its client) while nothing reaches outside without a network policy.
 * 0, or the step that failed (its errno set) */
static const char *loopback_up(void) {
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0) return "socket";
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    strcpy(ifr.ifr_name, "lo");
    const char *failed = NULL;
    if (ioctl(s, SIOCGIFFLAGS, &ifr) < 0) failed = "get flags";
    ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
    if (!failed && ioctl(s, SIOCSIFFLAGS, &ifr) < 0) failed = "set flags";
    int saved = errno;
    close(s);
    errno = saved;
    return failed;
}

static void child(const struct request *r, int sync_fd, int listen_fd, int log_fd) {
    char c;
    const char *root = ""; /* every path below is the sandbox's: made after pivot_root, see there */
    if (sync_fd >= 0) { /* a spare (see spare_wait) was placed in its cgroup before it got the request */
        if (read(sync_fd, &c, 1) != 1) _exit(1); /* the parent could not place us in the cgroup */
        close(sync_fd);
    }
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    if (!prepared) prepare_now();
    if (prepare_failed) {
        errno = prepare_errno;
        fail(prepare_failed, NULL);
    }
    empty_fd = early.empty;
    const char *lo_failed = ahead_lo ? NULL : loopback_up();
    if (lo_failed) fail(lo_failed, "lo");
    if (unshare(CLONE_NEWCGROUP) < 0) fail("unshare", "cgroup"); /* rooted at the sandbox's cgroup */
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) fail("make private", "/");
    if (mount("overlay", r->rootfs, "overlay", 0, r->overlay) < 0) fail("mount overlay", r->rootfs);
    /* pivot_root first, so that every path made or mounted on from here is resolved inside the sandbox's own
     * root: a symlink the image planted (/dev -> /etc, /.shoal -> /root) leads nowhere outside it (the host's
     * root is detached), where before the pivot it would lead into the host's tree */
    if (chdir(r->rootfs) < 0) fail("chdir", r->rootfs);
    if (syscall(SYS_pivot_root, ".", ".") < 0) fail("pivot_root", r->rootfs);
    if (umount2(".", MNT_DETACH) < 0) fail("umount", "old root");
    if (chdir("/") < 0) fail("chdir", "/");
    attach(&early.proc, "/proc");
    attach(&early.dev, "/dev");
    attach(&early.pts, "/dev/pts");
    attach(&early.shm, "/dev/shm");
    attach(&early.mqueue, "/dev/mqueue");
    if (ahead_sysfs >= 0) { /* a spare's, made ahead in its network namespace (see spare_wait) */
        if (mkdir("/sys", 0755) < 0 && errno != EEXIST) fail("mkdir", "/sys");
        if (move_mount(ahead_sysfs, "", AT_FDCWD, "/sys", MOVE_MOUNT_F_EMPTY_PATH) < 0) fail("move_mount", "/sys");
        close(ahead_sysfs);
    } else {
        mount_or_fail("sysfs", root, "/sys", "sysfs", MS_NOSUID | MS_NOEXEC | MS_NODEV | MS_RDONLY, NULL);
    }
    /* the agent's mount point: in the node's top layer (nothing made in the upper), else made here */
    struct stat st;
    if (lstat("/.shoal/agent", &st) < 0 || !S_ISREG(st.st_mode)) {
        if (mkdir("/.shoal", 0755) < 0 && errno != EEXIST) fail("mkdir", "/.shoal");
        int made = open("/.shoal/agent", O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0755);
        if (made < 0) fail("create", "/.shoal/agent");
        close(made);
    }
    attach(&early.agent, "/.shoal/agent");
    for (int i = 0; i < r->ntmpfs; i++) { /* sandbox root owns them; what is written counts as its memory */
        mkdir_p(r->tmpfs[i]);
        if (mount("tmpfs", r->tmpfs[i], "tmpfs", MS_NOSUID | MS_NODEV, "mode=755") < 0) fail("mount", r->tmpfs[i]);
    }
    for (int i = 0; i < conf.nmask; i++)
        if (!masked_early[i]) mask_path(root, conf.mask[i]);
    for (int i = 0; i < conf.nro; i++)
        if (!readonly_early[i]) readonly_path(root, conf.ro[i]);
    /* stdio as crun gives it: stdin /dev/null, stdout+stderr the log; fd 3 the agent's listening socket */
    int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (null_fd < 0) fail("open", "/dev/null");
    int hi_null = fcntl(null_fd, F_DUPFD_CLOEXEC, 100), hi_log = fcntl(log_fd, F_DUPFD_CLOEXEC, 100);
    int hi_listen = fcntl(listen_fd, F_DUPFD_CLOEXEC, 100);
    if (hi_null < 0 || hi_log < 0 || hi_listen < 0) fail("dup", NULL);
    if (dup2(hi_null, 0) < 0 || dup2(hi_log, 1) < 0 || dup2(hi_log, 2) < 0 || dup2(hi_listen, SOCK_FD) < 0)
        fail("dup2", NULL);
    if (syscall(SYS_close_range, 4, ~0U, 4 /* CLOSE_RANGE_CLOEXEC */) < 0) fail("close_range", NULL);
    if (strcmp(r->hostname, HOSTNAME) && sethostname(r->hostname, strlen(r->hostname)) < 0)
        fail("sethostname", r->hostname);
    struct __user_cap_header_struct head = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2] = {{0}};
    data[0].effective = data[0].permitted = (uint32_t)conf.caps;
    data[1].effective = data[1].permitted = (uint32_t)(conf.caps >> 32);
    if (syscall(SYS_capset, &head, data) < 0) fail("capset", NULL);
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) fail("no_new_privs", NULL);
    struct sock_fprog prog = {conf.bpf_len, conf.bpf};
    if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog) < 0) fail("seccomp", NULL);
    char *argv[] = {"/.shoal/agent", "--fd", "3", NULL};
    char *envp[] = {"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", NULL};
    execve(argv[0], argv, envp);
    fail("execve", argv[0]);
}

/* ------------------------------------------------------------------ the parent: cgroups, then the child */

static int write_file(const char *dir, const char *name, const char *value) {
    char path[4096];
    if ((size_t)snprintf(path, sizeof path, "%s/%s", dir, name) >= sizeof path) return -1;
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = write(fd, value, strlen(value));
    int saved = errno;
    close(fd);
    errno = saved;
    return n == (ssize_t)strlen(value) ? 0 : -1;
}

static int read_file(const char *dir, const char *name, char *out, size_t size) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, out, size - 1);
    close(fd);
    if (n < 0) return -1;
    out[n] = 0;
    return 0;
}

/* A new v1 cpuset cgroup has no cpus or mems: copy its parent's (as crun does), or nothing may run in it */
static int cpuset_inherit(const char *dir, const char *parent_dir) {
    char value[4096];
    static const char *names[] = {"cpuset.cpus", "cpuset.mems"};
    for (int i = 0; i < 2; i++) {
        if (read_file(dir, names[i], value, sizeof value) == 0 && value[0] != '\n' && value[0]) continue;
        if (read_file(parent_dir, names[i], value, sizeof value) < 0) return -1;
        if (write_file(dir, names[i], value) < 0) return -1;
    }
    return 0;
}

static const char *base_name(const char *hierarchy) {
    const char *slash = strrchr(hierarchy, '/');
    return slash ? slash + 1 : hierarchy;
}

/* The sandboxes' parent cgroup (e.g. shoal), made in every hierarchy once per launcher: its cpuset gets its
 * parent's cpus and mems and `cgroup.clone_children`, so the kernel gives each new sandbox cgroup the same
 * (a new v1 cpuset has none, and nothing may run in it) */
static char ready_parent[2048];

static int make_parent(const char *rel_parent) {
    char parent[4200];
    for (int i = 0; i < conf.ncg; i++) {
        const char *h = conf.cg[i];
        snprintf(parent, sizeof parent, "%s/%s", h, rel_parent);
        if (mkdir(parent, 0755) < 0 && errno != EEXIST) return -1;
        if (strcmp(base_name(h), "cpuset") == 0) {
            if (cpuset_inherit(parent, h) < 0 || write_file(parent, "cgroup.clone_children", "1") < 0) return -1;
        }
    }
    snprintf(ready_parent, sizeof ready_parent, "%s", rel_parent);
    return 0;
}

/* Whether the sandbox joins its parent's cpuset instead of one of its own. Why (issue 12): a sandbox's cpuset
 * would hold the parent's cpus and mems, nothing else, and each one costs the kernel a walk of all its
 * siblings when made (cpuset_css_online, with clone_children) and when removed (validate_change, then a
 * rebuild of the scheduler domains over every cpuset, under the cgroup mutex that the next create's mkdir
 * waits for): ~5 % of the machine at 3,000 live sandboxes. The limits that differ per sandbox (memory, pids,
 * cpu shares and quota, devices, freezer) stay in cgroups of its own; crun makes a cpuset per container. */
static int in_parent_cpuset(const char *hierarchy, const char *cgroup) {
    return strcmp(base_name(hierarchy), "cpuset") == 0 && strchr(cgroup, '/') != NULL;
}

static int write_devices(const char *dir) {
    if (write_file(dir, "devices.deny", "a") < 0) return -1;
    char path[4300];
    snprintf(path, sizeof path, "%s/devices.allow", dir);
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    for (int d = 0; d < conf.ndev; d++) { /* one rule per write, on one open file */
        if (write(fd, conf.dev[d], strlen(conf.dev[d])) != (ssize_t)strlen(conf.dev[d])) {
            int saved = errno;
            close(fd);
            errno = saved;
            return -1;
        }
    }
    close(fd);
    return 0;
}

static void limits_of(const struct request *r, struct limits *l) {
    snprintf(l->mem, sizeof l->mem, "%s", r->mem);
    snprintf(l->pids, sizeof l->pids, "%s", r->pids);
    snprintf(l->shares, sizeof l->shares, "%s", r->shares);
    snprintf(l->quota, sizeof l->quota, "%s", r->quota);
    snprintf(l->period, sizeof l->period, "%s", r->period);
}

/* memory.limit_in_bytes never above memsw.limit_in_bytes: lowered first, raised second ("" = unlimited) */
static int set_memory(const char *dir, const char *value) {
    const char *v = value[0] ? value : "-1";
    if (write_file(dir, "memory.limit_in_bytes", v) < 0) {
        if (errno != EINVAL || write_file(dir, "memory.memsw.limit_in_bytes", v) < 0) return -1;
        return write_file(dir, "memory.limit_in_bytes", v);
    }
    if (write_file(dir, "memory.memsw.limit_in_bytes", v) < 0 && errno != ENOENT) return -1;
    return 0;
}

/* Write into `dir` (of hierarchy `h`) the limits of `now` (crun's, for the bundle oci.py makes) that differ from
 * `was`: those a spare's cgroup was made with, or NULL for a new cgroup (the kernel's defaults) */
static int limit_dir(const char *h, const char *dir, const struct limits *now, const struct limits *was) {
    const char *name = base_name(h);
    if (strcmp(name, "memory") == 0 && strcmp(now->mem, was ? was->mem : "")) {
        if (set_memory(dir, now->mem) < 0) return -1;
    } else if (strcmp(name, "pids") == 0 && strcmp(now->pids, was ? was->pids : "")) {
        if (write_file(dir, "pids.max", now->pids[0] ? now->pids : "max") < 0) return -1;
    } else if (strcmp(name, "cpu") == 0) {
        if ((!was || strcmp(now->shares, was->shares)) && write_file(dir, "cpu.shares", now->shares) < 0) return -1;
        if (now->quota[0]) {
            /* each write of the period or the quota walks every cpu cgroup on the host (the kernel's
             * bandwidth check, __cfs_schedulable): at 3,000 live sandboxes a write is a scan of 3,000.
             * A new cgroup has the kernel's default period (100 ms, what the node asks): written only if
             * it differs; a spare's cgroup has the last create's, mostly the same */
            char current[32];
            if (read_file(dir, "cpu.cfs_period_us", current, sizeof current) < 0 ||
                strtol(current, NULL, 10) != atol(now->period))
                if (write_file(dir, "cpu.cfs_period_us", now->period) < 0) return -1;
            if ((!was || strcmp(now->quota, was->quota)) && write_file(dir, "cpu.cfs_quota_us", now->quota) < 0)
                return -1;
        } else if (was && was->quota[0]) {
            if (write_file(dir, "cpu.cfs_quota_us", "-1") < 0) return -1;
        }
    } else if (strcmp(name, "devices") == 0 && !was) {
        if (write_devices(dir) < 0) return -1;
    }
    return 0;
}

/* Make the sandbox's cgroup in every hierarchy and write its limits; on error, why */
static const char *make_cgroup(const struct request *r) {
    static char why[4800];
    char dir[4200], rel_parent[2048];
    struct limits now;
    limits_of(r, &now);
    snprintf(rel_parent, sizeof rel_parent, "%s", r->cgroup);
    char *cut = strrchr(rel_parent, '/');
    if (cut) *cut = 0;
    snprintf(dir, sizeof dir, "%s", rel_parent);
    if (cut && strcmp(ready_parent, rel_parent) && make_parent(rel_parent) < 0) goto failed;
    for (int i = 0; i < conf.ncg; i++) {
        const char *h = conf.cg[i], *name = base_name(h);
        if (in_parent_cpuset(h, r->cgroup)) continue; /* made by make_parent */
        snprintf(dir, sizeof dir, "%s/%s", h, r->cgroup);
        if (mkdir(dir, 0755) < 0) {
            /* the parent went (removed while no sandbox was in it): make it again */
            if (errno != ENOENT || !cut || make_parent(rel_parent) < 0 || mkdir(dir, 0755) < 0) goto failed;
        }
        if (limit_dir(h, dir, &now, NULL) < 0) goto failed;
        if (strcmp(name, "cpuset") == 0 && !cut && cpuset_inherit(dir, h) < 0) goto failed;
    }
    return NULL;
failed:
    snprintf(why, sizeof why, "cgroup %s: %s", dir, strerror(errno));
    return why;
}

static const char *join_cgroup(const struct request *r, pid_t pid) {
    static char why[4800];
    char dir[4096], text[32];
    snprintf(text, sizeof text, "%d", pid);
    for (int i = 0; i < conf.ncg; i++) {
        snprintf(dir, sizeof dir, "%s/%s", conf.cg[i], r->cgroup);
        if (in_parent_cpuset(conf.cg[i], r->cgroup)) *strrchr(dir, '/') = 0;
        if (write_file(dir, "cgroup.procs", text) < 0) {
            snprintf(why, sizeof why, "joining cgroup %s: %s", dir, strerror(errno));
            return why;
        }
    }
    return NULL;
}

/* ------------------------------------------------------------------ the spare: namespaces made ahead */

/* Why (issue 12): cloning into new PID, network, IPC and UTS namespaces costs ~0.8 ms here (the network
 * namespace ~0.6), on the create's critical path. The launcher makes the next sandbox's init ahead, while it
 * waits for requests: a process in fresh namespaces of those four kinds, with its /sys mounted, its loopback
 * up and what prepare() makes (none depends on the request), blocked reading its own socketpair. It waits
 * in a cgroup made for the next sandbox (see spare_cgroup), which a create renames to the sandbox's and gives
 * the limits that differ; else a create places it in the sandbox's cgroup (before it runs a step of its own,
 * as the sync pipe does for a child cloned on the spot). The create sends it the request as it came with its
 * three fds (the agent's listening socket, the log, the status pipe); the spare parses it, takes a mount
 * namespace of its own (made now, not ahead: a copy of the host's mount table as it is at this create, with
 * the layers mounted since) and goes on exactly as a child cloned on the spot. Nothing of a sandbox is shared
 * with another: each spare is one process and its namespaces serve one sandbox. It exits when the launcher
 * does (its socket's other end closes). */
static char raw[MSG_MAX];
static size_t raw_len;
static pid_t spare_pid;
static int spare_sock = -1, spare_failed, signal_fd = -1;

/* The spare's cgroup: `<parent>/.spare-<launcher pid>-<n>` in every hierarchy but cpuset (the parent's), made
 * by the spare itself while it waits, with the last create's limits (spare_limits), and joined by it. Why
 * (issue 12): a create otherwise makes a directory in each hierarchy and moves its init into each, and the
 * first move waits for an RCU grace period (cgroup_threadgroup_rwsem) and every mkdir for the cgroup mutex,
 * which the kernel holds while it removes closed sandboxes' memory cgroups (a walk of every superblock's LRU
 * lists): 15-100 ms of a create at 3,000 live sandboxes. A create that takes the spare renames the directories
 * (the same parent, as cgroup v1 allows) and writes only the limits that differ. The spare answers 'j' once
 * it is in its cgroup, 'n' if it could not make or join it (the create then makes the cgroup and moves it, as
 * for a child cloned on the spot); what is left of the directories is removed once it is out of them
 * (spare_cgroup_gone). The node removes those of a launcher that died (launcher.py). */
static char spare_cgname[2200];
static struct limits spare_limits, last_limits;
static int spare_seq;
static char spare_answer; /* its 'j' or 'n', once read */

static void spare_cgroup_dir(char *out, size_t size, const char *h, const char *rel) {
    if (in_parent_cpuset(h, rel)) snprintf(out, size, "%s/%s", h, ready_parent);
    else snprintf(out, size, "%s/%s", h, rel);
}

/* ------------------------------------------------------------------ kept cgroups: a closed sandbox's, reused */

/* Why (issue 12): removing a sandbox's cgroup takes its memory cgroup offline, and the kernel then reparents
 * every superblock's memcg-aware LRU lists (memcg_reparent_list_lrus: each live sandbox adds its overlay, proc,
 * sysfs, tmpfs, devpts and mqueue superblocks), in a worker holding the cgroup mutex that the next create's
 * rename, mkdir or cgroup.procs write waits for: ~4-11 CPU-ms per close at 3,000 live sandboxes, growing with
 * them. A destroyed sandbox's cgroup is kept instead, emptied (its init reaped: the kernel killed the rest of
 * its PID namespace first), renamed to a spare's name (`<parent>/.spare-<launcher pid>-<n>`, which every
 * cleanup of spares covers: leave, launcher.py's remove_spare_cgroups after a killed launcher, the node's
 * start) and handed to the next spare, which resets it before it joins it (spare_cgroup, reset_dir: memory
 * peak, fail counts and CPU usage zeroed, what is still charged reclaimed above a bound, the limits that
 * differ written; the devices list is every sandbox's), or to a create that finds no spare ready, reset the
 * same way by the launcher (take_kept_cgroup). Only one whose counters the node reads can be reset or are
 * zero is kept: no OOM kill in it (memory.oom_control's count cannot be reset and the node reads it as the
 * sandbox's), not frozen, no task left. At most conf.kept wait (SHOAL_KEPT_CGROUPS, 0: none); the others are
 * removed as before. */
#define KEPT_MAX 64 /* the most SHOAL_KEPT_CGROUPS may ask for */
static struct {
    char name[2200];
    struct limits limits;
} kept[KEPT_MAX];
static int nkept;
static int spare_reused;        /* the spare's cgroup is a kept one (not made): reset, not made */
static struct limits spare_was; /* ... with the limits its last sandbox had */

static void remove_cgroup(const char *rel) {
    char dir[4400];
    for (int i = 0; i < conf.ncg; i++) {
        if (in_parent_cpuset(conf.cg[i], rel)) continue;
        snprintf(dir, sizeof dir, "%s/%s", conf.cg[i], rel);
        (void)rmdir(dir);
    }
}

/* Whether a counter file holds a nonzero count: its line `key N` (key NULL: the file is the number); 1 if it
 * cannot be read */
static int counted(const char *dir, const char *file, const char *key) {
    char value[4096];
    if (read_file(dir, file, value, sizeof value) < 0) return 1;
    if (!key) return atol(value) != 0;
    size_t len = strlen(key);
    for (const char *line = value; line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL)
        if (!strncmp(line, key, len) && line[len] == ' ') return atol(line + len + 1) != 0;
    return 1;
}

/* A destroyed sandbox's cgroup (its init reaped) kept for the next spare; 0 if it is not (then removed) */
static int keep_cgroup(const struct sandbox *sb) {
    char dir[4400], from[4400], to[4400], value[64], name[2200];
    size_t plen = strlen(ready_parent);
    int memory = 0;
    if (nkept >= conf.kept || strncmp(sb->cgroup, ready_parent, plen) || sb->cgroup[plen] != '/' ||
        strchr(sb->cgroup + plen + 1, '/'))
        return 0; /* full, or not a child of the parent the spares are made in (renamed within one parent) */
    for (int i = 0; i < conf.ncg; i++) {
        const char *h = conf.cg[i], *base = base_name(h);
        if (in_parent_cpuset(h, sb->cgroup)) continue;
        snprintf(dir, sizeof dir, "%s/%s", h, sb->cgroup);
        if (!strcmp(base, "memory")) {
            if (counted(dir, "memory.oom_control", "oom_kill")) return 0;
            memory = 1;
        } else if (!strcmp(base, "pids") && counted(dir, "pids.current", NULL)) {
            return 0;
        } else if (!strcmp(base, "freezer") &&
                   (read_file(dir, "freezer.state", value, sizeof value) < 0 || strncmp(value, "THAWED", 6))) {
            return 0;
        }
    }
    if (!memory) return 0; /* nothing to save */
    snprintf(name, sizeof name, "%s/.spare-%d-%d", ready_parent, (int)getpid(), ++spare_seq);
    int done = 0;
    for (; done < conf.ncg; done++) {
        if (in_parent_cpuset(conf.cg[done], sb->cgroup)) continue;
        snprintf(from, sizeof from, "%s/%s", conf.cg[done], sb->cgroup);
        snprintf(to, sizeof to, "%s/%s", conf.cg[done], name);
        if (rename(from, to) < 0) break;
    }
    if (done < conf.ncg) { /* back to its name: removed by the caller */
        while (--done >= 0) {
            if (in_parent_cpuset(conf.cg[done], sb->cgroup)) continue;
            snprintf(from, sizeof from, "%s/%s", conf.cg[done], sb->cgroup);
            snprintf(to, sizeof to, "%s/%s", conf.cg[done], name);
            (void)rename(to, from);
        }
        return 0;
    }
    snprintf(kept[nkept].name, sizeof kept[nkept].name, "%s", name);
    kept[nkept++].limits = sb->limits;
    return 1;
}

/* In the spare, a kept cgroup's directory `dir` of hierarchy `h` made as a new one would be for the next
 * sandbox: the counters the node reads zeroed (memory peak, fail counts, CPU usage), and what its last sandbox
 * left charged at most KEPT_CHARGE_MAX. What is left is mostly page cache of the image's layers that it read
 * first (its own files went with its mounts and upper directory; kernel objects still referenced are uncharged
 * when freed): shared with every sandbox of the image and reclaimable under the next one's limit like its own,
 * so it is reclaimed (memory.force_empty) only above the bound, rather than evicted for the next sandbox to
 * read again at every create. */
#define KEPT_CHARGE_MAX (16L << 20)
static int reset_dir(const char *h, const char *dir) {
    const char *base = base_name(h);
    if (!strcmp(base, "memory")) {
        static const char *zero[] = {"memory.max_usage_in_bytes", "memory.failcnt"};
        static const char *zero_if_any[] = {"memory.memsw.max_usage_in_bytes", "memory.memsw.failcnt"};
        char value[64];
        if (read_file(dir, "memory.usage_in_bytes", value, sizeof value) < 0) return -1;
        if (atol(value) > KEPT_CHARGE_MAX && write_file(dir, "memory.force_empty", "0") < 0) return -1;
        for (size_t i = 0; i < sizeof zero / sizeof *zero; i++)
            if (write_file(dir, zero[i], "0") < 0) return -1;
        for (size_t i = 0; i < sizeof zero_if_any / sizeof *zero_if_any; i++)
            if (write_file(dir, zero_if_any[i], "0") < 0 && errno != ENOENT) return -1;
    } else if (!strcmp(base, "cpu") || !strcmp(base, "cpuacct") || !strcmp(base, "cpu,cpuacct")) {
        if (write_file(dir, "cpuacct.usage", "0") < 0 && errno != ENOENT) return -1;
    }
    return 0;
}

/* A create with no spare ready clones its child on the spot (the spare is made only while no create is in
 * flight: with 16 creates at once nearly every one does) and takes a kept cgroup too, renamed to the
 * sandbox's and reset here as a spare resets its own (reset_dir, then the limits that differ). Why (issue 12):
 * else each such create made a new directory in every hierarchy (8 mkdirs and a devices list) and, with the
 * kept ones never taken, its close removed one (8 rmdirs, a memory cgroup taken offline and freed by kernel
 * workers): 16 concurrent create+exec+close cycles kept almost none. One still charged above KEPT_CHARGE_MAX
 * is left for a spare (its reclaim would hold up every create in flight here). 1 if the sandbox has its
 * cgroup; 0: none kept, or a step failed (that kept cgroup is then removed), and the caller makes one. */
static int take_kept_cgroup(const struct request *r) {
    char from[4400], to[4400], value[64];
    size_t plen = strlen(ready_parent);
    if (!nkept || !plen || strncmp(r->cgroup, ready_parent, plen) || r->cgroup[plen] != '/' ||
        strchr(r->cgroup + plen + 1, '/'))
        return 0; /* none, or not a child of the parent the kept ones are in (renamed within one parent) */
    const char *name = kept[nkept - 1].name;
    if (strncmp(name, ready_parent, plen) || name[plen] != '/') return 0; /* make_spare removes it */
    for (int i = 0; i < conf.ncg; i++) {
        if (strcmp(base_name(conf.cg[i]), "memory")) continue;
        snprintf(from, sizeof from, "%s/%s", conf.cg[i], name);
        if (read_file(from, "memory.usage_in_bytes", value, sizeof value) < 0 || atol(value) > KEPT_CHARGE_MAX)
            return 0;
    }
    struct limits now, was = kept[--nkept].limits;
    limits_of(r, &now);
    int done = 0;
    for (; done < conf.ncg; done++) {
        if (in_parent_cpuset(conf.cg[done], r->cgroup)) continue;
        snprintf(from, sizeof from, "%s/%s", conf.cg[done], name);
        snprintf(to, sizeof to, "%s/%s", conf.cg[done], r->cgroup);
        if (rename(from, to) < 0) break;
    }
    if (done < conf.ncg) { /* back to its kept name, and removed */
        while (--done >= 0) {
            if (in_parent_cpuset(conf.cg[done], r->cgroup)) continue;
            snprintf(from, sizeof from, "%s/%s", conf.cg[done], name);
            snprintf(to, sizeof to, "%s/%s", conf.cg[done], r->cgroup);
            (void)rename(to, from);
        }
        remove_cgroup(name);
        return 0;
    }
    for (int i = 0; i < conf.ncg; i++) {
        if (in_parent_cpuset(conf.cg[i], r->cgroup)) continue;
        snprintf(to, sizeof to, "%s/%s", conf.cg[i], r->cgroup);
        if (reset_dir(conf.cg[i], to) < 0 || limit_dir(conf.cg[i], to, &now, &was) < 0) {
            remove_cgroup(r->cgroup);
            return 0;
        }
    }
    return 1;
}

/* In the spare, before it waits: make (or reset a kept one) and join its cgroup; 'j', or 'n' if any step
 * failed */
static char spare_cgroup(void) {
    char dir[4400], text[32];
    if (!spare_cgname[0]) return 'n';
    for (int i = 0; i < conf.ncg; i++) {
        if (in_parent_cpuset(conf.cg[i], spare_cgname)) continue;
        spare_cgroup_dir(dir, sizeof dir, conf.cg[i], spare_cgname);
        if (spare_reused ? reset_dir(conf.cg[i], dir) < 0 || limit_dir(conf.cg[i], dir, &spare_limits, &spare_was) < 0
                         : mkdir(dir, 0755) < 0 || limit_dir(conf.cg[i], dir, &spare_limits, NULL) < 0)
            return 'n';
    }
    snprintf(text, sizeof text, "%d", getpid());
    for (int i = 0; i < conf.ncg; i++) {
        spare_cgroup_dir(dir, sizeof dir, conf.cg[i], spare_cgname);
        if (write_file(dir, "cgroup.procs", text) < 0) return 'n';
    }
    return 'j';
}

/* The spare's cgroup directories once no process is in them (it was reaped, or moved to its sandbox's) */
static void spare_cgroup_gone(void) {
    if (!spare_cgname[0]) return;
    remove_cgroup(spare_cgname);
    spare_cgname[0] = 0;
}

/* A create takes the spare's cgroup: renamed to the sandbox's in every hierarchy, the limits that differ
 * written; NULL, or why not (then the directories are renamed back and the create fails: see create) */
static const char *take_spare_cgroup(const struct request *r) {
    static char why[4800];
    char from[4400], to[4400];
    struct limits now;
    limits_of(r, &now);
    int done = 0;
    for (; done < conf.ncg; done++) {
        const char *h = conf.cg[done];
        if (in_parent_cpuset(h, spare_cgname)) continue;
        spare_cgroup_dir(from, sizeof from, h, spare_cgname);
        spare_cgroup_dir(to, sizeof to, h, r->cgroup);
        if (rename(from, to) < 0) goto failed;
        if (limit_dir(h, to, &now, &spare_limits) < 0) {
            done++;
            goto failed;
        }
    }
    spare_cgname[0] = 0;
    return NULL;
failed:
    snprintf(why, sizeof why, "cgroup %s: %s", to, strerror(errno));
    while (--done >= 0) {
        if (in_parent_cpuset(conf.cg[done], spare_cgname)) continue;
        spare_cgroup_dir(from, sizeof from, conf.cg[done], spare_cgname);
        spare_cgroup_dir(to, sizeof to, conf.cg[done], r->cgroup);
        (void)rename(to, from);
    }
    return why;
}

static int split(char *msg, size_t len, char **fields);
static const char *fill_request(char **fields, int n, struct request *r);

/* The sandbox's /sys (read-only, nosuid, noexec, nodev, as crun mounts it), made while the spare waits: a
 * sysfs mount is keyed to the network namespace of whoever makes it, and finding out that it needs a new
 * superblock walks every sysfs superblock on the host (one per sandbox: ~12 % of the launcher's time at
 * 3,000 live). Made at the create instead if this fails. */
static int make_sysfs_ahead(void) {
    const unsigned attrs = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NOEXEC | MOUNT_ATTR_NODEV;
    return detached_fs("sysfs", "sysfs", NULL, attrs);
}

/* The template (see template_sysfs), made once the launcher has its settings: in a network namespace of its
 * own with its loopback up, then back in the launcher's; left at -1 (each sandbox mounts its own) if any step
 * fails */
static void make_template(void) {
    int here = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC), fd = -1;
    if (here < 0) return;
    if (unshare(CLONE_NEWNET) == 0) {
        if (!loopback_up() && (template_net = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC)) >= 0)
            fd = make_sysfs_ahead();
        if (setns(here, CLONE_NEWNET) < 0) { /* the launcher never stays in it */
            perror("shoal-launcher: setns back from the template's network namespace");
            exit(1);
        }
    }
    close(here);
    if (fd < 0) {
        if (template_net >= 0) close(template_net);
        template_net = -1;
        return;
    }
    /* its masks and read-only paths as a spare's prepare makes them (mask_early, readonly_early_path on
     * ahead_sysfs); one not made here (a file to mask: no /dev/null of a sandbox's here) is left to each
     * sandbox's */
    struct mount_attr ro = {.attr_set = MOUNT_ATTR_RDONLY | MOUNT_ATTR_RELATIME, .attr_clr = MOUNT_ATTR__ATIME};
    if (conf.empty[0] && (early.empty = detached_bind(conf.empty, &ro)) < 0) {
        close(fd);
        close(template_net);
        template_net = -1;
        return;
    }
    ahead_sysfs = fd;
    for (int i = 0; i < conf.nmask; i++) masked_template[i] = !strncmp(conf.mask[i], "/sys/", 5) && mask_early(i) > 0;
    for (int i = 0; i < conf.nro; i++)
        readonly_template[i] = !strncmp(conf.ro[i], "/sys/", 5) && readonly_early_path(i) > 0;
    ahead_sysfs = -1;
    if (early.empty >= 0) close(early.empty);
    early.empty = -1;
    template_sysfs = fd;
}

/* A sandbox's own sysfs (of its network namespace) in place of its /sys, a clone of the template: before a
 * network policy moves a veth into its namespace (else its /sys/class/net would not show it), and for one a
 * restarted node re-adopts (the template it cloned ended with its launcher). Made by a child that joins the
 * sandbox's network and mount namespaces, as a create makes it: sysfs read-only, nosuid, nodev, noexec, then
 * oci.py's masks and read-only paths under /sys (mask_path, readonly_path). Answered once done */
static void own_sysfs(const char *id, const char *pid_text) {
    pid_t pid = atoi(pid_text), child;
    int status[2];
    if (pid <= 0 || pipe2(status, O_CLOEXEC) < 0) {
        reply("%s err no sandbox pid %s, or no pipe", id, pid_text);
        return;
    }
    if ((child = fork()) == 0) {
        char path[64];
        close(status[0]);
        status_fd = status[1];
        snprintf(path, sizeof path, "/proc/%d/ns/net", (int)pid);
        int net = open(path, O_RDONLY | O_CLOEXEC);
        snprintf(path, sizeof path, "/proc/%d/ns/mnt", (int)pid);
        int mnt = open(path, O_RDONLY | O_CLOEXEC);
        if (net < 0 || mnt < 0) fail("namespaces of", pid_text);
        struct stat theirs, ours;
        if (fstat(mnt, &theirs) < 0 || stat("/proc/self/ns/mnt", &ours) < 0 || theirs.st_ino == ours.st_ino ||
            fstat(net, &theirs) < 0 || stat("/proc/self/ns/net", &ours) < 0 || theirs.st_ino == ours.st_ino) {
            errno = EPERM; /* not a sandbox's: never the host's /sys */
            fail("namespaces of", pid_text);
        }
        if (setns(net, CLONE_NEWNET) < 0) fail("join the network namespace of", pid_text);
        int fd = make_sysfs_ahead();
        if (fd < 0) fail("sysfs", NULL);
        struct mount_attr ro = {.attr_set = MOUNT_ATTR_RDONLY | MOUNT_ATTR_RELATIME, .attr_clr = MOUNT_ATTR__ATIME};
        if (conf.empty[0] && (empty_fd = detached_bind(conf.empty, &ro)) < 0) fail("bind", conf.empty);
        if (setns(mnt, CLONE_NEWNS) < 0) fail("join the mount namespace of", pid_text);
        if (chdir("/") < 0) fail("chdir", "/");
        if (umount2("/sys", MNT_DETACH | UMOUNT_NOFOLLOW) < 0 && errno != EINVAL) fail("umount", "/sys");
        if (move_mount(fd, "", AT_FDCWD, "/sys", MOVE_MOUNT_F_EMPTY_PATH) < 0) fail("move_mount", "/sys");
        for (int i = 0; i < conf.nmask; i++)
            if (!strncmp(conf.mask[i], "/sys/", 5)) mask_path("", conf.mask[i]);
        for (int i = 0; i < conf.nro; i++)
            if (!strncmp(conf.ro[i], "/sys/", 5)) readonly_path("", conf.ro[i]);
        _exit(0);
    }
    close(status[1]);
    char buf[700];
    ssize_t n = -1;
    if (child > 0)
        while ((n = read(status[0], buf, sizeof buf - 1)) < 0 && errno == EINTR) {
        }
    close(status[0]);
    int st = 0;
    if (child > 0)
        while (waitpid(child, &st, 0) < 0 && errno == EINTR) {
        }
    if (child < 0) reply("%s err fork: %s", id, strerror(errno));
    else if (n > 0) reply("%s err %.*s", id, (int)n, buf);
    else if (!WIFEXITED(st) || WEXITSTATUS(st)) reply("%s err its sysfs could not be made (status %d)", id, st);
    else reply("%s ok 0", id);
}

static void spare_wait(int sock) {
    static char msg[MSG_MAX];
    char joined = spare_cgroup(); /* first: what follows is charged to the sandbox's cgroup */
    if (send(sock, &joined, 1, MSG_NOSIGNAL) != 1) _exit(0); /* from now on a create may take it */
    ahead_sysfs = sysfs_ahead();
    ahead_lo = loopback_up() == NULL; /* else tried again at the create, where a failure is reported */
    prepare_now();                     /* a failure is reported at the create */
    char control[CMSG_SPACE(3 * sizeof(int))];
    struct iovec iov = {msg, sizeof msg - 1};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control, .msg_controllen = sizeof control};
    ssize_t n;
    while ((n = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC)) < 0 && errno == EINTR) {
    }
    if (n <= 0) _exit(0); /* the launcher exited (or dropped this spare) */
    struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
    int fds[3];
    if (!cm || cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS ||
        cm->cmsg_len != CMSG_LEN(sizeof fds))
        _exit(1);
    memcpy(fds, CMSG_DATA(cm), sizeof fds);
    close(sock);
    status_fd = fds[2];
    msg[n] = 0;
    char *fields[4 * MAX_LIST];
    struct request r;
    int nfields = split(msg, n, fields);
    if (nfields == 0 || fill_request(fields, nfields, &r)) {
        errno = EINVAL;
        fail("request", "spare");
    }
    if (unshare(CLONE_NEWNS) < 0) fail("unshare", "mount");
    child(&r, -1, fds[0], fds[1]);
}

static void make_spare(void) {
    int pair[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) < 0) {
        spare_failed = 1;
        return;
    }
    /* the parent is known once a create made it (see the main loop); the spare's limits are the last create's */
    spare_reused = 0;
    while (nkept > 0 && !spare_reused) { /* a kept cgroup of this parent if there is one (see keep_cgroup) */
        const char *name = kept[--nkept].name;
        size_t plen = strlen(ready_parent);
        if (!strncmp(name, ready_parent, plen) && name[plen] == '/') {
            snprintf(spare_cgname, sizeof spare_cgname, "%s", name);
            spare_was = kept[nkept].limits, spare_reused = 1;
        } else {
            remove_cgroup(name);
        }
    }
    if (!spare_reused)
        snprintf(spare_cgname, sizeof spare_cgname, "%s/.spare-%d-%d", ready_parent, (int)getpid(), ++spare_seq);
    spare_limits = last_limits;
    unsigned long flags = CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | SIGCHLD;
    pid_t pid = syscall(SYS_clone, flags, NULL, NULL, NULL, NULL);
    if (pid == 0) { /* keep nothing of the launcher's but this socket */
        close(pair[0]);
        close(SOCK_FD);
        close(signal_fd);
        for (int i = 0; i < npending; i++) close(pending[i].fd);
        spare_wait(pair[1]);
    }
    close(pair[1]);
    if (pid < 0) { /* tried again after the next create (a create clones on the spot meanwhile) */
        close(pair[0]);
        spare_failed = 1;
        return;
    }
    spare_pid = pid, spare_sock = pair[0];
}

static int send_to_spare(int sock, int listen_fd, int log_fd, int status_fd_) {
    int fds[3] = {listen_fd, log_fd, status_fd_};
    char control[CMSG_SPACE(sizeof fds)];
    memset(control, 0, sizeof control);
    struct iovec iov = {raw, raw_len};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control, .msg_controllen = sizeof control};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
    cm->cmsg_level = SOL_SOCKET, cm->cmsg_type = SCM_RIGHTS, cm->cmsg_len = CMSG_LEN(sizeof fds);
    memcpy(CMSG_DATA(cm), fds, sizeof fds);
    ssize_t n;
    while ((n = sendmsg(sock, &mh, MSG_NOSIGNAL)) < 0 && errno == EINTR) {
    }
    return n == (ssize_t)raw_len ? 0 : -1;
}

static void reaped(pid_t pid);

/* A spare that died or was killed: reaped now, its cgroup removed (in reaped) */
static void reap_spare(void) {
    pid_t pid = spare_pid;
    kill(pid, SIGKILL);
    while (waitpid(pid, NULL, 0) < 0 && errno == EINTR) {
    }
    reaped(pid);
}

/* Whether the spare is ready to be taken: it answered once done with its cgroup (a create does not wait for
 * it: one that comes sooner clones a child on the spot and leaves the spare for the next). One that died is
 * reaped. */
static int spare_ready(void) {
    if (spare_pid <= 0) return 0;
    if (spare_answer) return 1;
    char c;
    ssize_t n;
    while ((n = recv(spare_sock, &c, 1, MSG_DONTWAIT)) < 0 && errno == EINTR) {
    }
    if (n == 1) {
        spare_answer = c;
        return 1;
    }
    if (n < 0 && errno == EAGAIN) return 0;
    reap_spare(); /* gone or broken */
    return 0;
}

/* A sandbox's init that will not start: SIGKILLed; a spare that kept its cgroup is reaped and the cgroup
 * removed at once (no other step would: the spare is no longer the launcher's spare, nor yet a sandbox) */
static void drop(pid_t pid, int spare_cgroup) {
    kill(pid, SIGKILL);
    if (!spare_cgroup) return;
    while (waitpid(pid, NULL, 0) < 0 && errno == EINTR) {
    }
    spare_cgroup_gone();
}

static void create(const struct request *r, int listen_fd) {
    int sync[2] = {-1, -1}, status[2] = {-1, -1}, log_fd = -1, spare = -1, in_cgroup = 0;
    const char *why;
    spare_failed = 0;
    if (!conf.ready) {
        reply("%s err the launcher got no init message", r->id);
        return;
    }
    if (npending >= MAX_PENDING) {
        reply("%s err too many creates in flight", r->id);
        return;
    }
    if (listen_fd < 0) {
        reply("%s err no listening socket came with the request", r->id);
        return;
    }
    int use_spare = spare_ready();
    /* a spare in its own cgroup keeps it: renamed to the sandbox's and given its limits once the spare has the
     * request (below), while it sets the sandbox up */
    int take = use_spare && spare_answer == 'j' && spare_cgname[0];
    if (take) in_cgroup = 1;
    else if (!take_kept_cgroup(r) && (why = make_cgroup(r))) {
        reply("%s err %s", r->id, why);
        return;
    }
    log_fd = open(r->log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (log_fd < 0 || pipe2(status, O_CLOEXEC) < 0 || (!use_spare && pipe2(sync, O_CLOEXEC) < 0)) {
        reply("%s err %s: %s", r->id, log_fd < 0 ? r->log : "pipe", strerror(errno));
        goto out;
    }
    pid_t pid;
    if (use_spare) { /* the spare made ahead: it runs no step of its own before it gets the request */
        pid = spare_pid, spare = spare_sock;
        spare_pid = 0, spare_sock = -1, spare_answer = 0;
    } else {
        unsigned long flags = CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNS | SIGCHLD;
        pid = syscall(SYS_clone, flags, NULL, NULL, NULL, NULL);
        if (pid < 0) {
            reply("%s err clone: %s", r->id, strerror(errno));
            goto out;
        }
        if (pid == 0) {
            close(sync[1]);
            close(status[0]);
            status_fd = status[1];
            child(r, sync[0], listen_fd, log_fd);
        }
        close(sync[0]);
        sync[0] = -1;
        close(status[1]);
        status[1] = -1;
    }
    if (!in_cgroup && (why = join_cgroup(r, pid))) { /* the child never ran a step of its own: its sync read
                                                       * gets EOF */
        kill(pid, SIGKILL);
        reply("%s err %s", r->id, why);
        goto out;
    }
    if (use_spare && !in_cgroup) spare_cgroup_gone(); /* the spare was moved out of its cgroup */
    limits_of(r, &last_limits);           /* the next spare's */
    if (r->pidfile[0]) { /* as `crun run --pid-file`: for whoever looks for the sandbox's init later */
        char text[32];
        int n = snprintf(text, sizeof text, "%d", pid);
        int fd = open(r->pidfile, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
        if (fd < 0 || write(fd, text, n) != n) {
            int saved = errno;
            drop(pid, take);
            reply("%s err %s: %s", r->id, r->pidfile, strerror(saved));
            if (fd >= 0) close(fd);
            goto out;
        }
        close(fd);
    }
    if (spare >= 0 ? send_to_spare(spare, listen_fd, log_fd, status[1]) < 0 : write(sync[1], "g", 1) != 1) {
        int saved = errno;
        drop(pid, take);
        reply("%s err starting the sandbox: %s", r->id, strerror(saved));
        goto out;
    }
    /* Why here (issue 12): each rename waits for the cgroup mutex, which the kernel holds while it takes the
     * last closed sandbox's memory cgroup offline (a walk of every superblock's LRU lists); the spare's setup
     * (its mount namespace, pivot_root, seccomp, the agent's exec) no longer waits for it. The answer does:
     * it is sent once the spare has exec'd (finish), after this returns. Until then the spare runs only this
     * launcher's code, in this cgroup under the last create's limits, and it charges little (page tables, a
     * few inodes) */
    if (take && (why = take_spare_cgroup(r))) { /* renamed back: the spare and its cgroup go, the create fails */
        drop(pid, take);
        reply("%s err %s", r->id, why);
        goto out;
    }
    if (status[1] >= 0) { /* the spare has its own copy now: EOF on the status pipe once it has exec'd */
        close(status[1]);
        status[1] = -1;
    }
    if (nsandboxes == capsandboxes) {
        int cap = capsandboxes ? 2 * capsandboxes : 256;
        struct sandbox *grown = realloc(sandboxes, cap * sizeof *grown);
        if (!grown) {
            kill(pid, SIGKILL);
            reply("%s err out of memory", r->id);
            goto out;
        }
        sandboxes = grown, capsandboxes = cap;
    }
    sandboxes[nsandboxes].pid = pid;
    snprintf(sandboxes[nsandboxes].cgroup, sizeof sandboxes[nsandboxes].cgroup, "%s", r->cgroup);
    sandboxes[nsandboxes].limits = last_limits;
    sandboxes[nsandboxes++].destroy[0] = 0;
    pending[npending].fd = status[0];
    pending[npending].pid = pid;
    snprintf(pending[npending].id, sizeof pending[npending].id, "%s", r->id);
    npending++;
    status[0] = -1;
out:
    for (int *fd = (int[]){sync[0], sync[1], status[0], status[1], log_fd, spare}, n = 0; n < 6; n++)
        if (fd[n] >= 0) close(fd[n]);
}

/* The child's status pipe closed (exec'd: the agent runs, or it died) or carried its reason */
static void finish(int i) {
    char buf[700];
    ssize_t n = read(pending[i].fd, buf, sizeof buf - 1);
    if (n < 0 && errno == EINTR) return;
    siginfo_t info = {0};
    if (n > 0) {
        buf[n] = 0;
        reply("%s err %s", pending[i].id, buf);
    } else if (!find_sandbox(pending[i].pid) ||
               (waitid(P_PID, pending[i].pid, &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid)) {
        /* the pipe closed because the child died (a kill, an OOM kill while it set up), not because it exec'd */
        reply("%s err the sandbox's init died while it started (status %d)", pending[i].id, info.si_status);
    } else {
        reply("%s ok %d", pending[i].id, pending[i].pid);
    }
    close(pending[i].fd);
    pending[i] = pending[--npending];
}

/* A sandbox's init was reaped: the kernel killed the rest of its PID namespace before it could exit, so its
 * cgroup is empty; if the node asked to destroy it, keep (keep_cgroup) or remove the cgroup and answer */
static void reaped(pid_t pid) {
    if (pid == spare_pid) { /* the spare died before any create took it (killed): make another */
        close(spare_sock);
        spare_pid = 0, spare_sock = -1, spare_answer = 0;
        spare_cgroup_gone();
        return;
    }
    struct sandbox *sb = find_sandbox(pid);
    if (!sb) return;
    if (sb->destroy[0]) {
        char dir[4200];
        const char *failed = NULL;
        int kept_it = keep_cgroup(sb);
        for (int i = 0; i < conf.ncg && !kept_it; i++) {
            if (in_parent_cpuset(conf.cg[i], sb->cgroup)) continue;
            snprintf(dir, sizeof dir, "%s/%s", conf.cg[i], sb->cgroup);
            if (rmdir(dir) < 0 && errno != ENOENT) failed = conf.cg[i];
        }
        if (failed) reply("%s err cgroup %s/%s: %s", sb->destroy, failed, sb->cgroup, strerror(errno));
        else reply("%s ok 0", sb->destroy);
    }
    *sb = sandboxes[--nsandboxes];
}

/* Reaping. Why not only waitpid(-1) (issue 12): it walks every child of the launcher's, and every sandbox's
 * init is one (3,000 live: a scan of 3,000 per SIGCHLD, ~10 % of the launcher's time). A pid that the
 * SIGCHLD names, or one the launcher waits for, is reaped by its pid (the kernel looks it up directly). */
#define SCAN_MS 1000
static long long scanned_at;

static long long monotonic_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

static void reap_one(pid_t pid) {
    if (pid > 0 && waitpid(pid, NULL, WNOHANG) == pid) reaped(pid);
}

static void reap_all(void) {
    pid_t pid;
    while ((pid = waitpid(-1, NULL, WNOHANG)) > 0) reaped(pid); /* no zombies */
    scanned_at = monotonic_ms();
}

/* Kill a sandbox this launcher made; answered once it has been reaped (see reaped), or at once with "gone"
 * if it is no child of this launcher's (already reaped, or made by an earlier launcher) */
static void destroy(const char *id, const char *pid_text) {
    pid_t pid = atoi(pid_text);
    struct sandbox *sb = pid > 0 ? find_sandbox(pid) : NULL;
    if (!sb) {
        reply("%s gone 0", id);
        return;
    }
    snprintf(sb->destroy, sizeof sb->destroy, "%s", id);
    kill(pid, SIGKILL); /* our unreaped child: the pid cannot have been reused */
}

/* ------------------------------------------------------------------ requests */

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static int init(char **fields, int nfields) {
    for (int i = 0; i < nfields; i++) {
        char *k = fields[i], *v = strchr(k, '=');
        if (!v) continue;
        *v++ = 0;
        if (!strcmp(k, "agent")) snprintf(conf.agent, sizeof conf.agent, "%s", v);
        else if (!strcmp(k, "empty")) snprintf(conf.empty, sizeof conf.empty, "%s", v);
        else if (!strcmp(k, "nofile")) conf.nofile = atol(v);
        else if (!strcmp(k, "caps")) conf.caps = strtoull(v, NULL, 16);
        else if (!strcmp(k, "capmax")) conf.capmax = atoi(v);
        else if (!strcmp(k, "kept")) conf.kept = atoi(v) < KEPT_MAX ? atoi(v) : KEPT_MAX;
        else if (!strcmp(k, "mask") && conf.nmask < MAX_LIST) conf.mask[conf.nmask++] = strdup(v);
        else if (!strcmp(k, "ro") && conf.nro < MAX_LIST) conf.ro[conf.nro++] = strdup(v);
        else if (!strcmp(k, "cg") && conf.ncg < MAX_LIST) conf.cg[conf.ncg++] = strdup(v);
        else if (!strcmp(k, "dev") && conf.ndev < MAX_LIST) conf.dev[conf.ndev++] = strdup(v);
        else if (!strcmp(k, "bpf")) {
            size_t len = strlen(v) / 2;
            if (len % sizeof(struct sock_filter) || len == 0) return -1;
            unsigned char *bytes = malloc(len);
            for (size_t j = 0; j < len; j++) {
                int hi = hexval(v[2 * j]), lo = hexval(v[2 * j + 1]);
                if (hi < 0 || lo < 0) return -1;
                bytes[j] = hi << 4 | lo;
            }
            conf.bpf = (struct sock_filter *)bytes;
            conf.bpf_len = len / sizeof(struct sock_filter);
        }
    }
    if (!conf.agent[0] || !conf.bpf || !conf.nofile || !conf.ncg) return -1;
    conf.ready = 1;
    return 0;
}

static int split(char *msg, size_t len, char **fields) {
    int n = 0;
    for (size_t at = 0; at < len && n < 4 * MAX_LIST;) {
        fields[n++] = msg + at;
        at += strlen(msg + at) + 1;
    }
    return n;
}

/* A create request's fields (after op=create) into `r`; NULL, or why it is refused */
static const char *fill_request(char **fields, int n, struct request *r) {
    static char why[4200];
    *r = (struct request){.id = "?", .rootfs = "", .overlay = "", .log = "", .pidfile = "", .cgroup = "", .mem = "",
                          .pids = "", .shares = "1024", .quota = "", .period = "", .hostname = HOSTNAME};
    for (int i = 1; i < n; i++) {
        char *k = fields[i], *v = strchr(k, '=');
        if (!v) continue;
        *v++ = 0;
        const char **slot = !strcmp(k, "id")         ? &r->id
                            : !strcmp(k, "rootfs")   ? &r->rootfs
                            : !strcmp(k, "overlay")  ? &r->overlay
                            : !strcmp(k, "log")      ? &r->log
                            : !strcmp(k, "pidfile")  ? &r->pidfile
                            : !strcmp(k, "cgroup")   ? &r->cgroup
                            : !strcmp(k, "mem")      ? &r->mem
                            : !strcmp(k, "pids")     ? &r->pids
                            : !strcmp(k, "shares")   ? &r->shares
                            : !strcmp(k, "quota")    ? &r->quota
                            : !strcmp(k, "period")   ? &r->period
                            : !strcmp(k, "hostname") ? &r->hostname
                                                     : NULL;
        if (slot) *slot = v;
        if (!strcmp(k, "tmpfs")) {
            if (r->ntmpfs == MAX_LIST || v[0] != '/' || strstr(v, "..")) {
                snprintf(why, sizeof why, "tmpfs path %s refused", v);
                return why;
            }
            r->tmpfs[r->ntmpfs++] = v;
        }
    }
    if (strcmp(fields[0], "op=create") || !r->rootfs[0] || !r->overlay[0] || !r->log[0] || !r->cgroup[0] ||
        strstr(r->cgroup, ".."))
        return "malformed request";
    return NULL;
}

static void handle(char *msg, size_t len, int fd) {
    char *fields[4 * MAX_LIST];
    memcpy(raw, msg, len); /* as it came: a spare parses it again (see spare_wait) */
    raw_len = len;
    int n = split(msg, len, fields);
    if (n == 0) goto out;
    if (!strcmp(fields[0], "op=init")) {
        if (init(fields + 1, n - 1) < 0) {
            reply("init err incomplete or malformed init message");
        } else {
            if (template_sysfs < 0) make_template();
            reply("init ok 0");
        }
        goto out;
    }
    if (!strcmp(fields[0], "op=destroy") && n == 3 && !strncmp(fields[1], "id=", 3) && !strncmp(fields[2], "pid=", 4)) {
        destroy(fields[1] + 3, fields[2] + 4);
        goto out;
    }
    if (!strcmp(fields[0], "op=sysfs") && n == 3 && !strncmp(fields[1], "id=", 3) && !strncmp(fields[2], "pid=", 4)) {
        own_sysfs(fields[1] + 3, fields[2] + 4);
        goto out;
    }
    struct request r;
    const char *why = fill_request(fields, n, &r);
    if (why) {
        reply("%s err %s", r.id, why);
        goto out;
    }
    create(&r, fd);
out:
    if (fd >= 0) close(fd);
}

/* Exit: the spare with its cgroup goes (sandboxes keep running) */
static int leave(void) {
    if (spare_pid > 0) reap_spare();
    while (nkept > 0) remove_cgroup(kept[--nkept].name);
    return 0;
}

int main(void) {
    static char msg[MSG_MAX];
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigaddset(&chld, SIGTERM); /* the node's stop: leave as when its end closes */
    sigprocmask(SIG_BLOCK, &chld, NULL);
    int sfd = signal_fd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sfd < 0 || fcntl(SOCK_FD, F_SETFD, FD_CLOEXEC) < 0) {
        perror("shoal-launcher: setup (is fd 3 the node's socket?)");
        return 1;
    }
    prctl(PR_SET_NAME, "shoal-launcher", 0, 0, 0);
    for (;;) {
        struct pollfd fds[MAX_PENDING + 2];
        fds[0] = (struct pollfd){SOCK_FD, POLLIN, 0};
        fds[1] = (struct pollfd){sfd, POLLIN, 0};
        for (int i = 0; i < npending; i++) fds[i + 2] = (struct pollfd){pending[i].fd, POLLIN, 0};
        int nfds = npending + 2, wants_spare = ready_parent[0] && spare_pid <= 0 && !spare_failed && !npending;
        /* the spare is made when nothing else waits, no create included (its child's setup would share the
         * CPU with the clone), once a create made the sandboxes' parent cgroup (its own is made in it); with
         * children, a full reaping scan at least every second */
        int ready = poll(fds, nfds, wants_spare ? 0 : nsandboxes ? SCAN_MS : -1);
        if (ready < 0) {
            if (errno == EINTR) continue;
            perror("shoal-launcher: poll");
            return 1;
        }
        if (ready == 0) {
            if (wants_spare) make_spare();
            else reap_all();
            continue;
        }
        if (fds[1].revents) {
            struct signalfd_siginfo info;
            while (read(sfd, &info, sizeof info) > 0) {
                if (info.ssi_signo == SIGTERM) return leave();
                reap_one(info.ssi_pid);
            }
            /* SIGCHLDs that came together were read as one: the sandboxes being destroyed are looked at each
             * time (their answer waits on it), the others at the next full scan (a zombie for at most a second) */
            for (int i = nsandboxes - 1; i >= 0; i--)
                if (sandboxes[i].destroy[0]) reap_one(sandboxes[i].pid);
            if (spare_pid > 0) reap_one(spare_pid);
            if (monotonic_ms() - scanned_at >= SCAN_MS) reap_all();
        }
        for (int i = nfds - 1; i >= 2; i--)
            if (fds[i].revents) finish(i - 2);
        if (fds[0].revents) {
            char control[CMSG_SPACE(sizeof(int))];
            struct iovec iov = {msg, sizeof msg - 1};
            struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control,
                                .msg_controllen = sizeof control};
            ssize_t n = recvmsg(SOCK_FD, &mh, MSG_CMSG_CLOEXEC);
            if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
            if (n <= 0) return leave(); /* the node closed its end (stopped or died): sandboxes keep running */
            int fd = -1;
            struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
            if (cm && cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) memcpy(&fd, CMSG_DATA(cm), sizeof fd);
            msg[n] = 0;
            handle(msg, n, fd);
        }
    }
}
