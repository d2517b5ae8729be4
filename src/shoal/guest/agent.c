/*
 * shoal-agent: the guest agent that runs as PID 1 inside a shoal container.
 *
 * It accepts connections on an already-listening AF_UNIX stream socket
 * (fd 3 by default, or `--fd N`) and forks one handler per connection.  Each
 * handler serves one request (exec, file read/write/list/stat/mkdir/remove,
 * hello, a port relay) and exits, except an exec asked with EXEC_KEEP_CONN
 * that left nothing running: then the same handler takes the connection's next
 * exec, so the node's exec path costs one fork (the command's), not an accept
 * and two.  The main process only accepts and reaps.
 *
 * Wire format (both directions): u32 length L (type byte + payload), u8 type,
 * L-1 payload bytes.  All integers are big-endian.  See client.py for the
 * request/reply catalogue.
 *
 * Build: gcc -O2 -static -Wall -Wextra -o shoal-agent agent.c
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/falloc.h>
#include <linux/random.h>
#include <linux/capability.h>
#include <setjmp.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <time.h>
#include <unistd.h>

#define AGENT_VERSION "shoal-agent 1"
#define MAX_FRAME (16u << 20)     /* max L (type byte + payload) */
#define PIPE_CHUNK (64u << 10)    /* max bytes per 'O'/'R' frame */
#define FILE_CHUNK (1u << 20)     /* max bytes per 'D' frame */
#define STDIN_HIGH (1u << 20)     /* stop reading the client above this much pending stdin */
#define DRAIN_IDLE_NS 20000000LL  /* after exit: finish once pipes are idle this long */
#define DRAIN_MAX_NS 2000000000LL /* after exit: finish at the latest after this long */
#define EXIT_LINGER_NS 2000000000LL /* after the exit frame: wait this long at most for the node to close */
#define PID_HOLD_NS 1000000LL       /* EXEC_HOLD_PID: the pid frame waits at most this long for company */
#define DEFAULT_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

/* VMs only (the guest kernel is ours to configure): every command runs in this cgroup, whose pids.max the
 * node sets after each restore ('I'); the agent, its handlers, keepers and reserve stay in the parent, so
 * a fork bomb at the limit never keeps them from forking the kill. */
#define CGROUP_ROOT "/sys/fs/cgroup"
#define COMMANDS_CGROUP CGROUP_ROOT "/shoal-commands"
/* VMs with a disk cap: space the sandbox may not write is held by this preallocated file on the root file
 * system (unwritten extents: it costs the host's qcow2 nothing). Found through a bind mount of / alone, so in
 * a microvm it lies under the agent's tmpfs on /.shoal, out of every command's sight. */
#define DISK_HOLD_DIR "/.shoal/disk-cap"
#define DISK_HOLD_FILE ".shoal/disk-cap-hold"

#define EXEC_STDIN_PIPE 1u
#define EXEC_MERGE_STDERR 2u
#define EXEC_BG_FOLLOW 4u /* 'B': the starter follows it on the same connection (as 'A' FOLLOW from 0) */
#define EXEC_KEEP_CONN 8u /* 'E': the node keeps the connection for its next exec if this one leaves nothing behind */
#define EXEC_HOLD_PID 16u /* 'E': the handler sends the pid frame with the command's first output or exit frame,
                             or after PID_HOLD_NS (do_exec), not the child before it execs */
#define WRITE_MKDIRS 1u
#define WRITE_APPEND 2u

/* ------------------------------------------------------------------------ */
/* Handler-global state                                                      */

static pid_t agent_pid = 0;     /* the main (accepting) process */
static int conn = -1;           /* the client connection of this handler */
static pid_t cmd_pid = 0;       /* exec: the command (also its pgid/sid) */
static int cmd_reaped = 0;      /* exec: cmd_pid has been waited for */
static int cmd_status = 0;      /* exec: its wait status */
static int exec_ready = 0;      /* exec: SIGCHLD's handler and this handler's slot are set */
static int sigchld_pipe[2] = {-1, -1};
static int commands_cgroup = -1; /* VMs: the guest cgroup every command enters (O_PATH dir), -1 elsewhere */
static int ignores_all = 0;      /* every catchable signal is SIG_IGN here (PID 1 under gVisor: main) */
static int64_t pid_hold_ns = PID_HOLD_NS; /* tests lengthen it: SHOAL_AGENT_PID_HOLD_MS in the agent's env */

static unsigned char obuf[PIPE_CHUNK + 1024]; /* buffered outgoing frames */
static size_t olen = 0;

static unsigned char *ibuf = NULL; /* buffered incoming bytes */
static size_t icap = 0, ilen = 0, ipos = 0;

static void kill_tree(int sig);

/* Agent processes: the main one, the handlers it forked (an exec's handler lingers as the "keeper" of what
 * the command left running), and one pre-forked reserve that serves hello, process lists and kills when
 * the sandbox's pids limit leaves no room to fork a handler.  Main records each child it forks in this
 * table, shared (MAP_SHARED, made before any fork) with every agent process and lost at exec, so no
 * command can see or forge it; a handler marks its own slot when it starts a command.  Every other
 * process in the sandbox belongs to the exec whose handler is its topmost ancestor below main: handlers
 * are child subreapers, so neither forking, double-forking nor setsid escapes that ancestry while the
 * handler (or its keeper) lives. */
#define AGENT_SLOTS 4096
#define SLOT_HANDLER 1
#define SLOT_EXEC 2
#define SLOT_RESERVE 3
#define SLOT_BG 4 /* the keeper of a background process (procs.c), which outlives its connection */
struct slot {
    int pid;
    int kind;
    int cmd, status, pty; /* SLOT_BG: the command, its wait status (-1: running), a terminal or not */
    uint64_t total[2];    /* SLOT_BG: bytes of stdout and stderr (or the terminal's output) so far */
};
static struct slot *slots = NULL;

static void put_u32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)(v >> 24);
    p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
}

static void put_u64(unsigned char *p, uint64_t v) {
    put_u32(p, (uint32_t)(v >> 32));
    put_u32(p + 4, (uint32_t)v);
}

static uint32_t rd_u32(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int in_reserve = 0; /* the reserve serves many connections: a lost one returns to its loop */
static sigjmp_buf reserve_jmp;

/* The client went away: kill whatever we started and leave. */
static void conn_lost(void) {
    if (in_reserve)
        siglongjmp(reserve_jmp, 1);
    if (cmd_pid > 0)
        kill_tree(SIGKILL);
    _exit(1);
}

/* ------------------------------------------------------------------------ */
/* Output                                                                    */

static void writev_all(struct iovec *iov, int cnt) {
    while (cnt > 0) {
        ssize_t n = writev(conn, iov, cnt);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            conn_lost();
        }
        while (cnt > 0 && (size_t)n >= iov->iov_len) {
            n -= (ssize_t)iov->iov_len;
            iov++;
            cnt--;
        }
        if (cnt > 0) {
            iov->iov_base = (char *)iov->iov_base + n;
            iov->iov_len -= (size_t)n;
        }
    }
}

static void flush_out(void) {
    if (olen == 0)
        return;
    struct iovec iov = {obuf, olen};
    writev_all(&iov, 1);
    olen = 0;
}

static void send_frame(char type, const void *data, size_t len) {
    unsigned char hdr[5];
    put_u32(hdr, (uint32_t)(len + 1));
    hdr[4] = (unsigned char)type;
    if (len + 5 > sizeof(obuf) - olen)
        flush_out();
    if (len + 5 <= sizeof(obuf) - olen) {
        memcpy(obuf + olen, hdr, 5);
        if (len)
            memcpy(obuf + olen + 5, data, len);
        olen += len + 5;
        return;
    }
    struct iovec iov[2] = {{hdr, 5}, {(void *)data, len}};
    writev_all(iov, 2);
}

static void send_err(int err, const char *fmt, ...) {
    unsigned char buf[4 + 1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf((char *)buf + 4, sizeof(buf) - 4, fmt, ap);
    va_end(ap);
    if (n < 0)
        n = 0;
    if ((size_t)n > sizeof(buf) - 5)
        n = (int)(sizeof(buf) - 5);
    put_u32(buf, (uint32_t)err);
    send_frame('Z', buf, 4 + (size_t)n);
    flush_out();
}

static void send_ok(const void *data, size_t len) {
    send_frame('A', data, len);
    flush_out();
}

/* 'N' record: u8 kind, u32 mode, u32 uid, u32 gid, u64 size, i64 mtime_ns,
 * name\0, target\0 */
static void send_stat(const char *name, const struct stat *st, const char *target) {
    size_t nl = strlen(name), tl = strlen(target);
    size_t len = 1 + 4 + 4 + 4 + 8 + 8 + nl + 1 + tl + 1;
    unsigned char stackbuf[4096];
    unsigned char *b = len <= sizeof(stackbuf) ? stackbuf : malloc(len);
    if (!b)
        _exit(1);
    char kind = S_ISREG(st->st_mode) ? 'f' : S_ISDIR(st->st_mode) ? 'd' : S_ISLNK(st->st_mode) ? 'l' : 'o';
    b[0] = (unsigned char)kind;
    put_u32(b + 1, (uint32_t)(st->st_mode & 07777));
    put_u32(b + 5, (uint32_t)st->st_uid);
    put_u32(b + 9, (uint32_t)st->st_gid);
    put_u64(b + 13, (uint64_t)st->st_size);
    put_u64(b + 21, (uint64_t)((int64_t)st->st_mtim.tv_sec * 1000000000LL + st->st_mtim.tv_nsec));
    memcpy(b + 29, name, nl + 1);
    memcpy(b + 29 + nl + 1, target, tl + 1);
    send_frame('N', b, len);
    if (b != stackbuf)
        free(b);
}

/* ------------------------------------------------------------------------ */
/* Input                                                                     */

/* Read more bytes from the client.  Returns >0 bytes read, 0 on EOF, -1 if it
 * would block (nonblocking mode), -2 on error. */
static int fill_input(int blocking) {
    if (ipos > 0) {
        memmove(ibuf, ibuf + ipos, ilen - ipos);
        ilen -= ipos;
        ipos = 0;
    }
    size_t want = 64u << 10;
    if (ilen >= 4) {
        uint32_t l = rd_u32(ibuf);
        if (l <= MAX_FRAME && 4 + (size_t)l > ilen + want)
            want = 4 + (size_t)l - ilen;
    }
    if (icap - ilen < want) {
        size_t ncap = ilen + want;
        unsigned char *nb = realloc(ibuf, ncap);
        if (!nb)
            return -2;
        ibuf = nb;
        icap = ncap;
    }
    for (;;) {
        ssize_t n = recv(conn, ibuf + ilen, icap - ilen, blocking ? 0 : MSG_DONTWAIT);
        if (n > 0) {
            ilen += (size_t)n;
            return 1;
        }
        if (n == 0)
            return 0;
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK)
            return -1;
        return -2;
    }
}

/* Take one complete frame from the input buffer, if there is one.  The
 * payload pointer stays valid until the next fill_input(). */
static int next_frame(char *type, unsigned char **payload, uint32_t *plen) {
    size_t avail = ilen - ipos;
    if (avail < 5)
        return 0;
    uint32_t l = rd_u32(ibuf + ipos);
    if (l == 0 || l > MAX_FRAME) {
        send_err(EMSGSIZE, "bad frame length %u (max %u)", l, MAX_FRAME);
        conn_lost();
    }
    if (avail < 4 + (size_t)l)
        return 0;
    *type = (char)ibuf[ipos + 4];
    *payload = ibuf + ipos + 5;
    *plen = l - 1;
    ipos += 4 + (size_t)l;
    return 1;
}

/* Blocking read of one frame; returns 0 on EOF/error. */
static int read_frame(char *type, unsigned char **payload, uint32_t *plen) {
    while (!next_frame(type, payload, plen)) {
        if (fill_input(1) <= 0)
            return 0;
    }
    return 1;
}

/* Payload cursor */
struct cur {
    const unsigned char *p;
    size_t n;
    int bad;
};

static uint32_t get_u32(struct cur *c) {
    if (c->n < 4) {
        c->bad = 1;
        return 0;
    }
    uint32_t v = rd_u32(c->p);
    c->p += 4;
    c->n -= 4;
    return v;
}

static uint64_t get_u64(struct cur *c) {
    uint64_t hi = get_u32(c);
    return (hi << 32) | get_u32(c);
}

static uint8_t get_u8(struct cur *c) {
    if (c->n < 1) {
        c->bad = 1;
        return 0;
    }
    uint8_t v = c->p[0];
    c->p++;
    c->n--;
    return v;
}

static const char *get_str(struct cur *c) {
    const unsigned char *z = c->n ? memchr(c->p, 0, c->n) : NULL;
    if (!z) {
        c->bad = 1;
        return "";
    }
    const char *s = (const char *)c->p;
    c->n -= (size_t)(z - c->p) + 1;
    c->p = z + 1;
    return s;
}

/* ------------------------------------------------------------------------ */
/* Process tree handling                                                     */

static void reap_children(void) {
    int st;
    pid_t p;
    while ((p = waitpid(-1, &st, WNOHANG)) > 0) {
        if (p == cmd_pid) {
            cmd_status = st;
            cmd_reaped = 1;
        }
    }
}

/* A process's state and parent from /proc/<pid>/stat; -1 if it is gone (or unreadable). */
static int read_stat(int pid, char *state, int *ppid) {
    char path[64], buf[512];
    snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t r = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (r <= 0)
        return -1;
    buf[r] = 0;
    char *rp = strrchr(buf, ')'); /* the command name may hold spaces and parentheses */
    return rp && sscanf(rp + 1, " %c %d", state, ppid) == 2 ? 0 : -1;
}

/* Signal every live descendant of this process; returns how many. */
static int kill_descendants(int sig) {
    DIR *d = opendir("/proc");
    if (!d)
        return 0;
    size_t cap = 256, n = 0;
    pid_t *pids = malloc(cap * sizeof(pid_t)), *ppids = malloc(cap * sizeof(pid_t));
    char *zomb = malloc(cap);
    if (!pids || !ppids || !zomb) {
        closedir(d);
        free(pids);
        free(ppids);
        free(zomb);
        return 0;
    }
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] < '1' || e->d_name[0] > '9')
            continue;
        int pid = atoi(e->d_name), ppid;
        char state;
        if (read_stat(pid, &state, &ppid) < 0)
            continue;
        if (n == cap) {
            cap *= 2;
            pid_t *np = realloc(pids, cap * sizeof(pid_t));
            if (np)
                pids = np;
            pid_t *npp = realloc(ppids, cap * sizeof(pid_t));
            if (npp)
                ppids = npp;
            char *nz = realloc(zomb, cap);
            if (nz)
                zomb = nz;
            if (!np || !npp || !nz)
                break;
        }
        pids[n] = (pid_t)pid;
        ppids[n] = (pid_t)ppid;
        zomb[n] = (char)(state == 'Z' || state == 'X');
        n++;
    }
    closedir(d);

    /* Mark descendants: in_tree[i] = 1 if i's parent chain reaches us.  The
     * tree is usually small, so membership is checked against a pid list. */
    char *in_tree = calloc(n ? n : 1, 1);
    pid_t *tree = malloc((n + 1) * sizeof(pid_t));
    size_t nt = 0;
    int killed = 0;
    if (in_tree && tree) {
        tree[nt++] = getpid();
        int changed = 1;
        while (changed) {
            changed = 0;
            for (size_t i = 0; i < n; i++) {
                if (in_tree[i])
                    continue;
                for (size_t j = 0; j < nt; j++) {
                    if (tree[j] == ppids[i]) {
                        in_tree[i] = 1;
                        tree[nt++] = pids[i];
                        changed = 1;
                        break;
                    }
                }
            }
        }
        for (size_t i = 0; i < n; i++) {
            if (in_tree[i] && !zomb[i] && kill(pids[i], sig) == 0)
                killed++;
        }
    }
    free(in_tree);
    free(tree);
    free(pids);
    free(ppids);
    free(zomb);
    return killed;
}

/* Signal the command's process group and every descendant of this handler.
 * For SIGKILL repeat until nothing is left (processes may fork meanwhile). */
static void kill_tree(int sig) {
    for (int round = 0; round < 200; round++) {
        if (cmd_pid > 0)
            kill(-cmd_pid, sig);
        int n = kill_descendants(sig);
        reap_children();
        if (sig != SIGKILL || n == 0)
            return;
        if (round > 0)
            usleep(1000);
    }
}

static void slots_init(void) {
    void *m = mmap(NULL, AGENT_SLOTS * sizeof(struct slot), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                   -1, 0);
    slots = m == MAP_FAILED ? NULL : m;
}

static void slot_add(pid_t pid, int kind) {
    for (int i = 0; slots && i < AGENT_SLOTS; i++) {
        if (__atomic_load_n(&slots[i].pid, __ATOMIC_SEQ_CST) == 0) {
            slots[i].cmd = slots[i].pty = 0;
            slots[i].status = -1;
            slots[i].total[0] = slots[i].total[1] = 0;
            __atomic_store_n(&slots[i].kind, kind, __ATOMIC_SEQ_CST);
            __atomic_store_n(&slots[i].pid, (int)pid, __ATOMIC_SEQ_CST);
            return;
        }
    }
}

static void slot_del(pid_t pid) { /* main only, from its SIGCHLD handler */
    for (int i = 0; slots && i < AGENT_SLOTS; i++) {
        if (__atomic_load_n(&slots[i].pid, __ATOMIC_SEQ_CST) == (int)pid) {
            __atomic_store_n(&slots[i].kind, 0, __ATOMIC_SEQ_CST);
            __atomic_store_n(&slots[i].pid, 0, __ATOMIC_SEQ_CST);
        }
    }
}

static int slot_kind(pid_t pid) {
    for (int i = 0; slots && i < AGENT_SLOTS; i++) {
        if (__atomic_load_n(&slots[i].pid, __ATOMIC_SEQ_CST) == (int)pid)
            return __atomic_load_n(&slots[i].kind, __ATOMIC_SEQ_CST);
    }
    return 0;
}

static void slot_mark_self(int kind) {
    pid_t self = getpid();
    for (int i = 0; slots && i < AGENT_SLOTS; i++) {
        if (__atomic_load_n(&slots[i].pid, __ATOMIC_SEQ_CST) == (int)self)
            __atomic_store_n(&slots[i].kind, kind, __ATOMIC_SEQ_CST);
    }
}

/* fork, recorded in the slot table before SIGCHLD can report the child gone (main only). */
static pid_t agent_fork(int kind) {
    sigset_t chld, old;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigprocmask(SIG_BLOCK, &chld, &old);
    pid_t pid = fork();
    if (pid > 0)
        slot_add(pid, kind);
    /* The child waits until main has recorded it: what it marks in its slot (slot_mark_self) and who it
       claims to be to a background process's keeper (procs.c) depend on that record. */
    for (int i = 0; pid == 0 && slots && i < 100000 && slot_kind(getpid()) == 0; i++)
        sched_yield();
    sigprocmask(SIG_SETMASK, &old, NULL);
    return pid;
}

struct proc {
    pid_t pid, ppid, top; /* top: the ancestor whose parent is main (0: not below main, or unknown yet) */
    int broken;           /* its ancestry runs into a parent gone from /proc: being reparented right now */
    char state;
    int kind; /* slot kind: an agent process if nonzero (or pid == main) */
};

static int cmp_proc(const void *a, const void *b) {
    pid_t x = ((const struct proc *)a)->pid, y = ((const struct proc *)b)->pid;
    return x < y ? -1 : x > y;
}

static struct proc *find_proc(struct proc *ps, size_t n, pid_t pid) {
    struct proc key = {.pid = pid};
    return bsearch(&key, ps, n, sizeof(*ps), cmp_proc);
}

/* Every process in /proc with its parent, state, agent kind and top ancestor below main; sorted by pid. */
static struct proc *scan_procs(size_t *count) {
    *count = 0;
    DIR *d = opendir("/proc");
    if (!d)
        return NULL;
    size_t cap = 256, n = 0;
    struct proc *ps = malloc(cap * sizeof(*ps));
    struct dirent *e;
    while (ps && (e = readdir(d))) {
        if (e->d_name[0] < '1' || e->d_name[0] > '9')
            continue;
        int pid = atoi(e->d_name), ppid;
        char state;
        /* An agent process is taken for one if it is known as one before or after its stat is read: a handler
           that exits and is reaped (its slot freed) in between would otherwise look like a live command whose
           exec is itself (kill_processes then reported it left). */
        int kind = pid == agent_pid ? -1 : slot_kind(pid);
        if (read_stat(pid, &state, &ppid) < 0)
            continue;
        if (n == cap) {
            struct proc *np = realloc(ps, cap * 2 * sizeof(*ps));
            if (!np)
                break;
            ps = np;
            cap *= 2;
        }
        ps[n++] = (struct proc){(pid_t)pid, (pid_t)ppid, 0, 0, state, kind};
    }
    closedir(d);
    if (!ps)
        return NULL;
    qsort(ps, n, sizeof(*ps), cmp_proc);
    for (size_t i = 0; i < n; i++) {
        if (ps[i].kind == 0)
            ps[i].kind = slot_kind(ps[i].pid);
    }
    for (size_t i = 0; i < n; i++) {
        struct proc *p = &ps[i];
        for (int depth = 0; p && depth < 100000; depth++) {
            if (p->ppid == agent_pid) {
                ps[i].top = p->pid;
                break;
            }
            struct proc *up = p->ppid > 0 ? find_proc(ps, n, p->ppid) : NULL;
            if (!up && p->ppid > 0)
                ps[i].broken = 1; /* its parent exited after the listing began: ask again next round */
            p = up;
        }
    }
    *count = n;
    return ps;
}

/* A process of the sandbox's commands (not the agent's own), below main; of exec `exec` unless 0. */
static int is_user_proc(const struct proc *p, pid_t exec) {
    if (p->kind != 0 || p->top == 0 || p->state == 'Z' || p->state == 'X')
        return 0;
    return exec == 0 || p->top == exec;
}

/* SIGKILL every process of exec `exec` (0: of every exec), again until none is left; how many were
 * signalled.  Never forks: served by the reserve when the pids limit is exhausted.  A process with a
 * pending SIGKILL cannot complete a fork, so a fork bomb dies out within a few rounds. */
static uint32_t kill_user_procs(pid_t exec, uint32_t *left) {
    size_t cap = 256, nk = 0; /* distinct pids signalled (a dying process is seen again next round) */
    pid_t *seen = malloc(cap * sizeof(pid_t));
    *left = 0;
    /* At least 1000 rounds and 10 s: in a VM guest starved of CPU by a loaded host, killed processes were
       seen to outlast 1000 quick rounds (no one of 62 gone) and the kill returned with them still there. */
    int64_t give_up = now_ns() + 10000000000LL;
    for (int round = 0; round < 1000 || now_ns() < give_up; round++) {
        size_t n;
        struct proc *ps = scan_procs(&n);
        uint32_t hit = 0, unsure = 0;
        for (size_t i = 0; ps && i < n; i++) {
            if (ps[i].broken && ps[i].kind == 0 && ps[i].state != 'Z')
                unsure++;
            if (!is_user_proc(&ps[i], exec) || kill(ps[i].pid, SIGKILL) != 0)
                continue;
            hit++;
            size_t k = 0;
            while (seen && k < nk && seen[k] != ps[i].pid)
                k++;
            if (seen && k == nk) {
                if (nk == cap) {
                    pid_t *more = realloc(seen, cap * 2 * sizeof(pid_t));
                    if (more) {
                        seen = more;
                        cap *= 2;
                    }
                }
                if (nk < cap)
                    seen[nk++] = ps[i].pid;
            }
        }
        free(ps);
        *left = hit;
        if (hit == 0 && (unsure == 0 || round > 900))
            break;
        if (round > 0)
            usleep(round < 10 ? 200 : 2000);
    }
    free(seen);
    return (uint32_t)nk;
}

/* 'K': u32 exec (0: all) -> 'A' u32 killed, u32 still there after the last round. */
static void do_kill_procs(const unsigned char *pl, uint32_t plen) {
    pid_t exec = plen >= 4 ? (pid_t)rd_u32(pl) : 0;
    uint32_t left = 0, killed = kill_user_procs(exec, &left);
    size_t n;
    struct proc *ps = scan_procs(&n);
    left = 0;
    for (size_t i = 0; ps && i < n; i++)
        left += (uint32_t)is_user_proc(&ps[i], exec);
    free(ps);
    unsigned char out[8];
    put_u32(out, killed);
    put_u32(out + 4, left);
    send_ok(out, 8);
}

/* 'Q' -> 'A' u32 count, then per process: u32 pid, u32 ppid, u32 exec (its handler; 0 if that is gone),
 * u8 state, command line\0 (at most 255 bytes, NULs as spaces; [comm] for kernel-less ones). */
static void do_list_procs(void) {
    size_t n;
    struct proc *ps = scan_procs(&n);
    size_t cap = 4 + n * (13 + 256), len = 4;
    unsigned char *out = malloc(cap);
    if (!out) {
        free(ps);
        send_err(ENOMEM, "process list: out of memory");
        return;
    }
    uint32_t count = 0;
    for (size_t i = 0; ps && i < n; i++) {
        if (!is_user_proc(&ps[i], 0))
            continue;
        char path[64], cmd[256];
        snprintf(path, sizeof(path), "/proc/%d/cmdline", (int)ps[i].pid);
        ssize_t r = -1;
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd >= 0) {
            r = read(fd, cmd, sizeof(cmd) - 1);
            close(fd);
        }
        if (r <= 0) {
            snprintf(path, sizeof(path), "/proc/%d/comm", (int)ps[i].pid);
            char comm[64] = "";
            fd = open(path, O_RDONLY | O_CLOEXEC);
            if (fd >= 0) {
                ssize_t c = read(fd, comm, sizeof(comm) - 1);
                close(fd);
                comm[c > 0 ? c : 0] = 0;
                comm[strcspn(comm, "\n")] = 0;
            }
            r = snprintf(cmd, sizeof(cmd), "[%s]", comm);
        } else {
            for (ssize_t k = 0; k < r; k++)
                if (cmd[k] == 0)
                    cmd[k] = ' ';
            while (r > 0 && cmd[r - 1] == ' ')
                r--;
        }
        cmd[r] = 0;
        int top_kind = slot_kind(ps[i].top), exec = top_kind == SLOT_EXEC || top_kind == SLOT_BG ? ps[i].top : 0;
        put_u32(out + len, (uint32_t)ps[i].pid);
        put_u32(out + len + 4, (uint32_t)ps[i].ppid);
        put_u32(out + len + 8, (uint32_t)exec);
        out[len + 12] = (unsigned char)ps[i].state;
        memcpy(out + len + 13, cmd, (size_t)r + 1);
        len += 13 + (size_t)r + 1;
        count++;
    }
    free(ps);
    put_u32(out, count);
    send_ok(out, len);
    free(out);
}

static void on_sigchld(int s) {
    (void)s;
    int saved = errno;
    char c = 0;
    (void)!write(sigchld_pipe[1], &c, 1);
    errno = saved;
}

/* ------------------------------------------------------------------------ */
/* exec                                                                      */

/* After the command exited: if processes it started still run (`nohup server &`), stay as their keeper
 * (a subreaper, so they stay this exec's for lists and kills) until the last one is gone. */
static void keep_leftovers(void) {
    reap_children();
    if (waitpid(-1, NULL, WNOHANG) < 0 && errno == ECHILD)
        return;
    close(conn);
    conn = -1;
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = SIG_DFL;
    sigaction(SIGCHLD, &sa, NULL);
    close(sigchld_pipe[0]);
    close(sigchld_pipe[1]);
    prctl(PR_SET_NAME, "shoal-keeper");
    for (;;) {
        if (waitpid(-1, NULL, 0) < 0 && errno != EINTR)
            return;
    }
}

static void child_fail(const char *what, const char *arg, int err) {
    dprintf(2, "shoal: %s %s: %s\n", what, arg, strerror(err));
    _exit(err == EACCES ? 126 : 127);
}

static void exec_sh(const char *path, char **argv, char **envp) {
    int argc = 0;
    while (argv[argc])
        argc++;
    char **nargv = calloc((size_t)argc + 2, sizeof(char *));
    if (!nargv)
        return;
    nargv[0] = "/bin/sh";
    nargv[1] = (char *)path;
    for (int i = 1; i < argc; i++)
        nargv[i + 1] = argv[i];
    execve("/bin/sh", nargv, envp);
    errno = ENOEXEC;
}

/* execvpe() that looks up PATH in envp (glibc uses the caller's environ). */
static void exec_search(char **argv, char **envp) {
    const char *file = argv[0];
    if (!*file)
        child_fail("exec", file, ENOENT);
    if (strchr(file, '/')) {
        execve(file, argv, envp);
        if (errno == ENOEXEC)
            exec_sh(file, argv, envp);
        child_fail("exec", file, errno);
    }
    const char *path = DEFAULT_PATH;
    for (char **e = envp; *e; e++) {
        if (strncmp(*e, "PATH=", 5) == 0)
            path = *e + 5;
    }
    size_t flen = strlen(file);
    int saw_eacces = 0;
    char buf[PATH_MAX];
    for (const char *p = path;; p++) {
        const char *end = strchrnul(p, ':');
        size_t dlen = (size_t)(end - p);
        if (dlen == 0) {
            if (flen + 1 <= sizeof(buf))
                memcpy(buf, file, flen + 1);
        } else if (dlen + 1 + flen + 1 <= sizeof(buf)) {
            memcpy(buf, p, dlen);
            buf[dlen] = '/';
            memcpy(buf + dlen + 1, file, flen + 1);
        } else {
            goto next;
        }
        execve(buf, argv, envp);
        switch (errno) {
        case EACCES:
            saw_eacces = 1;
            break;
        case ENOENT:
        case ENOTDIR:
        case ESTALE:
        case ENODEV:
        case ETIMEDOUT:
        case ENAMETOOLONG:
        case ELOOP:
            break;
        case ENOEXEC:
            exec_sh(buf, argv, envp);
            child_fail("exec", file, errno);
            break;
        default:
            child_fail("exec", file, errno);
        }
    next:
        if (!*end)
            break;
        p = end;
    }
    child_fail("exec", file, saw_eacces ? EACCES : ENOENT);
}

static void exec_child(const char *cwd, uint32_t uid, uint32_t gid, int in_rd, int out_wr,
                       int err_wr, char **argv, char **envp) {
    setsid();
    {
        /* Commands are the OOM killer's first choice (+1000), before the agent and the node (which also
           try -1000; that needs CAP_SYS_RESOURCE, raising a score does not, so this works on every host). */
        int oom = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
        if (oom >= 0) {
            if (write(oom, "1000", 4) < 0) { /* best effort */ }
            close(oom);
        }
    }
    if (in_rd < 0) {
        in_rd = open("/dev/null", O_RDONLY | O_CLOEXEC);
        if (in_rd < 0)
            child_fail("open", "/dev/null", errno);
    }
    /* All source fds are > 2 (fds 0-2 are always open) and CLOEXEC. */
    if (dup2(in_rd, 0) < 0 || dup2(out_wr, 1) < 0 || dup2(err_wr, 2) < 0)
        _exit(127);
    if (isatty(0)) /* a background process on a terminal (procs.c): it becomes the session's */
        ioctl(0, TIOCSCTTY, 0);
    /* Default dispositions for the command. execve resets caught signals itself but keeps ignored ones, and
       a child that shares our memory (spawn_exec) must not run our handlers: so SIGPIPE (ignored by every
       agent process), SIGCHLD, SIGTERM and SIGINT (caught by some), or, where the agent ignores every
       signal (gVisor), all of them. One rt_sigaction per signal cost an exec 64 system calls, each through
       the sandbox's seccomp filter. */
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = SIG_DFL;
    static const int caught[] = {SIGPIPE, SIGCHLD, SIGTERM, SIGINT};
    if (ignores_all) {
        for (int s = 1; s < NSIG; s++)
            sigaction(s, &sa, NULL);
    } else {
        for (size_t i = 0; i < sizeof(caught) / sizeof(caught[0]); i++)
            sigaction(caught[i], &sa, NULL);
    }
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    if (commands_cgroup >= 0) { /* VMs: under the sandbox's pids limit (the agent stays outside it) */
        int procs = openat(commands_cgroup, "cgroup.procs", O_WRONLY | O_CLOEXEC);
        if (procs < 0 || write(procs, "0", 1) != 1)
            child_fail("entering the commands' cgroup", COMMANDS_CGROUP, errno);
        close(procs);
    }
    if (chdir(cwd) < 0)
        child_fail("chdir", cwd, errno);
    if (uid != (uint32_t)getuid() || gid != (uint32_t)getgid() || uid != (uint32_t)geteuid() ||
        gid != (uint32_t)getegid()) {
        char ids[32];
        snprintf(ids, sizeof(ids), "%u:%u", uid, gid);
        if (setgroups(0, NULL) < 0 && errno != EPERM)
            child_fail("setgroups", ids, errno);
        if (setgid((gid_t)gid) < 0)
            child_fail("setgid", ids, errno);
        if (setuid((uid_t)uid) < 0)
            child_fail("setuid", ids, errno);
    }
    exec_search(argv, envp);
}

static int set_nonblock(int fd) {
    int fl = fcntl(fd, F_GETFL);
    return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

/* The last `cap` bytes of one output stream past its head (the head goes out as it is printed): what an
 * over-long output ends with (a test runner's summary line) survives the output cap.  `dropped` counts
 * the bytes between head and tail that were cut. */
struct tail {
    unsigned char *buf;
    size_t cap, start, len;
    uint64_t dropped;
};

static void tail_put(struct tail *t, const unsigned char *p, size_t n) {
    if (t->cap == 0 || (!t->buf && !(t->buf = malloc(t->cap)))) {
        t->cap = 0; /* no memory for a tail: cut everything past the head */
        t->dropped += n;
        return;
    }
    if (n > t->cap) {
        t->dropped += n - t->cap;
        p += n - t->cap;
        n = t->cap;
    }
    size_t over = t->len + n > t->cap ? t->len + n - t->cap : 0; /* <= len since n <= cap */
    t->start = (t->start + over) % t->cap;
    t->len -= over;
    t->dropped += over;
    size_t end = (t->start + t->len) % t->cap;
    size_t first = n < t->cap - end ? n : t->cap - end;
    memcpy(t->buf + end, p, first);
    memcpy(t->buf, p + first, n - first);
    t->len += n;
}

/* Send what the tail holds, after a 'Q' frame (stream, bytes cut) if anything was cut before it. */
static void tail_send(struct tail *t, int k) {
    if (t->dropped) {
        unsigned char q[12];
        put_u32(q, (uint32_t)k);
        put_u64(q + 4, t->dropped);
        send_frame('Q', q, sizeof(q));
    }
    while (t->len) {
        size_t first = t->cap - t->start < t->len ? t->cap - t->start : t->len;
        if (first > PIPE_CHUNK)
            first = PIPE_CHUNK;
        send_frame(k ? 'R' : 'O', t->buf + t->start, first);
        t->start = (t->start + first) % t->cap;
        t->len -= first;
    }
    free(t->buf);
    t->buf = NULL;
}

/* An exec request: u32 cap, u32 uid, u32 gid, u32 flags, cwd\0, u32 argc, argv\0..., u32 envc, env\0...
 * (a background start, procs.c, adds its terminal size after).  The strings point into the payload. */
struct exec_req {
    uint32_t cap, uid, gid, flags;
    const char *cwd;
    char **argv, **envp;
};

/* Parse an exec request into `r`; the cursor stays past it.  Answers 'Z' and returns -1 if malformed. */
static int parse_exec(struct cur *c, struct exec_req *r, uint32_t plen) {
    r->cap = get_u32(c);
    r->uid = get_u32(c);
    r->gid = get_u32(c);
    r->flags = get_u32(c);
    r->cwd = get_str(c);
    uint32_t argc = get_u32(c);
    if (c->bad || argc == 0 || argc > plen) {
        send_err(EINVAL, "exec: malformed request");
        return -1;
    }
    r->argv = calloc((size_t)argc + 1, sizeof(char *));
    if (!r->argv) {
        send_err(ENOMEM, "exec: out of memory");
        return -1;
    }
    for (uint32_t i = 0; i < argc; i++)
        r->argv[i] = (char *)get_str(c);
    uint32_t envc = get_u32(c);
    if (c->bad || envc > plen) {
        send_err(EINVAL, "exec: malformed request");
        return -1;
    }
    r->envp = calloc((size_t)envc + 1, sizeof(char *));
    if (!r->envp) {
        send_err(ENOMEM, "exec: out of memory");
        return -1;
    }
    for (uint32_t i = 0; i < envc; i++)
        r->envp[i] = (char *)get_str(c);
    if (c->bad) {
        send_err(EINVAL, "exec: malformed request");
        return -1;
    }
    return 0;
}

/* The command of an exec, started by a child that shares the handler's memory and stops it until the child
 * execs or exits (CLONE_VM | CLONE_VFORK, as posix_spawn does): no copy of the handler's page tables and no
 * copy-on-write faults after it, which a fork cost every exec (and more so under a paravirtualised MMU).
 * The child sends the exec's pid frame ('P': its pid and the handler's) itself before it execs, so the
 * command starts only once the node can know it started: a command that kills every process it can
 * (`kill -9 -1` takes the handler too) cannot do so before the node has its pid.  Except with `hold`
 * (EXEC_HOLD_PID): then the handler sends it, with the command's first frame (do_exec), and a connection
 * that ends before it once the handler read the request may be a command that started (guest/client.py). */
struct spawn {
    const char *cwd;
    uint32_t uid, gid;
    int in_rd, out_wr, err_wr;
    char **argv, **envp;
    int failed; /* set by the child: the pid frame could not be sent (the command never started) */
    int follow; /* 1 + the pty flag: a background start that the starter follows (EXEC_BG_FOLLOW), whose
                   follower's own 'P' (pid, keeper, pty) goes out in the same send; 0: the start's 'P' only */
    int *slot_cmd; /* a keeper's slot's `cmd`: set by the child before its 'P' goes out, so the process is
                      listed ('J') as soon as the node can know it started (not only once it has exec'd) */
    int hold;      /* EXEC_HOLD_PID: the child sends no 'P'; the handler does */
};

static int spawn_child(void *arg) {
    struct spawn *sp = arg;
    unsigned char f[27];
    uint32_t pid = (uint32_t)syscall(SYS_getpid), parent = (uint32_t)syscall(SYS_getppid);
    put_u32(f, 9);
    f[4] = 'P';
    put_u32(f + 5, pid);
    put_u32(f + 9, parent);
    size_t len = 13;
    if (sp->slot_cmd)
        __atomic_store_n(sp->slot_cmd, (int)pid, __ATOMIC_SEQ_CST);
    if (sp->follow) { /* the follower's first frame too: one wakeup of the node, not a second one after exec */
        put_u32(f + 13, 10);
        f[17] = 'P';
        put_u32(f + 18, pid);
        put_u32(f + 22, parent);
        f[26] = (unsigned char)(sp->follow - 1);
        len = 27;
    }
    for (size_t off = sp->hold ? len : 0; off < len;) {
        ssize_t n = send(conn, f + off, len - off, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            sp->failed = 1;
            _exit(127);
        }
        off += (size_t)n;
    }
    exec_child(sp->cwd, sp->uid, sp->gid, sp->in_rd, sp->out_wr, sp->err_wr, sp->argv, sp->envp);
    return 127;
}

static pid_t spawn_exec(struct spawn *sp) {
    static unsigned char *stack = NULL; /* the child's; one at a time (the handler waits while it runs) */
    const size_t size = 256u << 10;
    if (!stack) {
        void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
        if (m == MAP_FAILED)
            return -1;
        stack = m;
    }
    /* No handler of ours may run in the child (it shares our memory) before it set them to default. */
    sigset_t all, old;
    sigfillset(&all);
    sigprocmask(SIG_SETMASK, &all, &old);
    sp->failed = 0;
    pid_t pid = clone(spawn_child, stack + size, CLONE_VM | CLONE_VFORK | SIGCHLD, sp);
    int err = errno;
    sigprocmask(SIG_SETMASK, &old, NULL);
    errno = err;
    return pid;
}

/* No process of this handler's is left (the command's leftovers would be its children: it is a subreaper). */
static int no_children(void) {
    reap_children();
    pid_t p;
    while ((p = waitpid(-1, NULL, WNOHANG)) > 0) {
    }
    return p < 0 && errno == ECHILD;
}

/* Run one exec request; 1 if the connection stays for the node's next exec (EXEC_KEEP_CONN, and the
 * command left nothing running: the exit frame says so), else 0 once this handler is done with it. */
static int do_exec(const unsigned char *pl, uint32_t plen) {
    struct cur c = {pl, plen, 0};
    struct exec_req rq;
    if (parse_exec(&c, &rq, plen) < 0)
        return 0;
    uint32_t cap = rq.cap, uid = rq.uid, gid = rq.gid, flags = rq.flags;
    const char *cwd = rq.cwd;
    char **argv = rq.argv, **envp = rq.envp;

    int merge = (flags & EXEC_MERGE_STDERR) != 0;
    int outp[2] = {-1, -1}, errp[2] = {-1, -1}, inp[2] = {-1, -1};
    if (pipe2(outp, O_CLOEXEC) < 0 || (!merge && pipe2(errp, O_CLOEXEC) < 0) ||
        ((flags & EXEC_STDIN_PIPE) && pipe2(inp, O_CLOEXEC) < 0) ||
        (sigchld_pipe[0] < 0 && pipe2(sigchld_pipe, O_CLOEXEC | O_NONBLOCK) < 0)) {
        send_err(errno, "exec %s: pipe: %s", argv[0], strerror(errno));
        return 0;
    }
    if (!exec_ready) { /* once per handler: its later execs on a kept connection find both in place */
        struct sigaction sa;
        memset(&sa, 0, sizeof(sa));
        sa.sa_handler = on_sigchld;
        sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
        sigaction(SIGCHLD, &sa, NULL);
        slot_mark_self(SLOT_EXEC);
        exec_ready = 1;
    }
    int hold = (flags & EXEC_HOLD_PID) != 0;
    flush_out(); /* the child writes the pid frame straight to the connection */
    struct spawn sp = {cwd, uid, gid, inp[0], outp[1], merge ? outp[1] : errp[1], argv, envp, 0, 0, NULL, hold};
    pid_t pid = spawn_exec(&sp);
    if (pid < 0) {
        send_err(errno, "exec %s: fork: %s", argv[0], strerror(errno));
        return 0;
    }
    cmd_pid = pid;
    /* A held pid frame waits in the output buffer for the command's first output or its exit frame (a short
       command's exec then wakes the node once, not twice: issue 12), or until PID_HOLD_NS passed. */
    int64_t hold_until = 0;
    if (hold) {
        unsigned char pf[8];
        put_u32(pf, (uint32_t)pid);
        put_u32(pf + 4, (uint32_t)syscall(SYS_getpid));
        send_frame('P', pf, sizeof(pf));
        hold_until = now_ns() + pid_hold_ns;
    }
    close(outp[1]);
    if (!merge)
        close(errp[1]);
    if (inp[0] >= 0)
        close(inp[0]);
    int fds[2] = {outp[0], merge ? -1 : errp[0]};
    int in_fd = inp[1];
    /* The output pipes stay blocking: they are read only after poll said so, which never blocks. */
    if (in_fd >= 0)
        set_nonblock(in_fd);
    if (sp.failed) /* the connection broke before the pid frame went out: the command did not start */
        conn_lost();

    static unsigned char buf[PIPE_CHUNK];
    /* With a cap, the first cap - cap/2 bytes of each stream go out live and the last cap/2 at the end. */
    uint64_t head = cap ? (uint64_t)cap - cap / 2 : 0, sent[2] = {0, 0};
    struct tail tails[2] = {{NULL, cap / 2, 0, 0, 0}, {NULL, cap / 2, 0, 0, 0}};
    unsigned char *inbuf = NULL;
    size_t in_len = 0, in_off = 0;
    int close_pending = 0;
    int64_t exit_at = 0, last_data = 0;

    reap_children();
    for (;;) {
        if (cmd_reaped) {
            if (exit_at == 0)
                exit_at = last_data = now_ns();
            if (in_fd >= 0) {
                close(in_fd);
                in_fd = -1;
            }
        }
        if (in_fd >= 0 && close_pending && in_len == in_off) {
            close(in_fd);
            in_fd = -1;
        }
        int timeout = -1;
        if (cmd_reaped) {
            if (fds[0] < 0 && fds[1] < 0)
                break;
            int64_t t = now_ns();
            int64_t left = last_data + DRAIN_IDLE_NS - t;
            if (exit_at + DRAIN_MAX_NS - t < left)
                left = exit_at + DRAIN_MAX_NS - t;
            if (left <= 0)
                break;
            timeout = (int)((left + 999999) / 1000000);
        }
        if (hold_until) {
            int64_t left = hold_until - now_ns();
            if (left <= 0) {
                hold_until = 0;
            } else {
                int ms = (int)((left + 999999) / 1000000);
                if (timeout < 0 || ms < timeout)
                    timeout = ms;
            }
        }
        if (!hold_until)
            flush_out();

        struct pollfd pfd[5];
        int np = 0, i_conn, i_sig, i_out[2] = {-1, -1}, i_in = -1;
        i_conn = np;
        pfd[np++] = (struct pollfd){conn, (short)(in_len - in_off < STDIN_HIGH ? POLLIN : 0), 0};
        i_sig = np;
        pfd[np++] = (struct pollfd){sigchld_pipe[0], POLLIN, 0};
        for (int k = 0; k < 2; k++) {
            if (fds[k] >= 0) {
                i_out[k] = np;
                pfd[np++] = (struct pollfd){fds[k], POLLIN, 0};
            }
        }
        if (in_fd >= 0 && in_len > in_off) {
            i_in = np;
            pfd[np++] = (struct pollfd){in_fd, POLLOUT, 0};
        }
        int r = poll(pfd, (nfds_t)np, timeout);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            conn_lost();
        }
        if (r == 0)
            continue; /* drain deadline re-checked at the top */

        if (pfd[i_sig].revents) {
            char tmp[64];
            while (read(sigchld_pipe[0], tmp, sizeof(tmp)) > 0) {
            }
            reap_children();
        }
        for (int k = 0; k < 2; k++) {
            if (i_out[k] < 0 || !pfd[i_out[k]].revents)
                continue;
            ssize_t n = read(fds[k], buf, sizeof(buf));
            if (n > 0) {
                size_t take = (size_t)n;
                if (cap && sent[k] + take > head)
                    take = sent[k] >= head ? 0 : (size_t)(head - sent[k]);
                if (take) {
                    send_frame(k ? 'R' : 'O', buf, take);
                    hold_until = 0; /* output goes out now, and the pid frame before it */
                }
                sent[k] += take;
                if (take < (size_t)n)
                    tail_put(&tails[k], buf + take, (size_t)n - take);
                last_data = now_ns();
            } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
                close(fds[k]);
                fds[k] = -1;
            }
        }
        if (i_in >= 0 && pfd[i_in].revents) {
            ssize_t n = write(in_fd, inbuf + in_off, in_len - in_off);
            if (n > 0) {
                in_off += (size_t)n;
                if (in_off == in_len)
                    in_off = in_len = 0;
            } else if (n < 0 && errno != EINTR && errno != EAGAIN) {
                close(in_fd); /* EPIPE: the command closed its stdin */
                in_fd = -1;
                in_off = in_len = 0;
            }
        }
        short crev = pfd[i_conn].revents;
        if (crev & POLLIN) {
            int fr = fill_input(0);
            if (fr == 0 || fr == -2)
                conn_lost();
            char type;
            unsigned char *p;
            uint32_t n;
            while (next_frame(&type, &p, &n)) {
                if (type == 'I') {
                    if (in_fd < 0 || close_pending || n == 0)
                        continue;
                    if (in_off > 0) { /* compact so the buffer stays bounded */
                        memmove(inbuf, inbuf + in_off, in_len - in_off);
                        in_len -= in_off;
                        in_off = 0;
                    }
                    unsigned char *nb = realloc(inbuf, in_len + n);
                    if (!nb)
                        conn_lost();
                    inbuf = nb;
                    memcpy(inbuf + in_len, p, n);
                    in_len += n;
                } else if (type == 'C') {
                    close_pending = 1;
                } else if (type == 'K' && n >= 4) {
                    uint32_t sig = rd_u32(p);
                    if (sig > 0 && sig < (uint32_t)NSIG)
                        kill_tree((int)sig);
                }
            }
        } else if (crev & (POLLHUP | POLLERR)) {
            conn_lost();
        }
    }

    int code, sig = 0;
    if (WIFEXITED(cmd_status)) {
        code = WEXITSTATUS(cmd_status);
    } else {
        sig = WIFSIGNALED(cmd_status) ? WTERMSIG(cmd_status) : 0;
        code = 128 + sig;
    }
    for (int k = 0; k < 2; k++)
        tail_send(&tails[k], k);
    /* Decided before the exit frame, which tells the node: a command that left processes running makes
       this handler their keeper (its pid names the exec), so it cannot serve another exec. */
    int keep = (flags & EXEC_KEEP_CONN) && no_children();
    unsigned char x[25];
    put_u32(x, (uint32_t)code);
    put_u32(x + 4, (uint32_t)sig);
    put_u64(x + 8, tails[0].dropped);
    put_u64(x + 16, tails[1].dropped);
    x[24] = (unsigned char)keep;
    send_frame('X', x, sizeof(x));
    flush_out();
    for (int k = 0; k < 2; k++) /* what the leftovers write now goes nowhere, as before keepers */
        if (fds[k] >= 0)
            close(fds[k]);
    if (in_fd >= 0)
        close(in_fd);
    free(inbuf);
    if (keep) { /* back to a clean handler: the next frame on the connection may be another exec */
        free(argv);
        free(envp);
        cmd_pid = 0;
        cmd_reaped = cmd_status = 0;
        return 1;
    }
    /* Stay until the node closes (it does once it has read 'X'), reading and dropping what it sends: stdin
       frames it wrote while the command was already exiting must reach a live socket, or its write fails
       (EPIPE) and it loses the exit frame already sent.  Bounded, in case the node never closes. */
    int64_t until = now_ns() + EXIT_LINGER_NS;
    for (;;) {
        int64_t left = until - now_ns();
        if (left <= 0)
            break;
        struct pollfd p = {conn, POLLIN, 0};
        int r = poll(&p, 1, (int)((left + 999999) / 1000000));
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        ssize_t n = recv(conn, buf, sizeof(buf), 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
    }
    keep_leftovers();
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Files                                                                     */

/* Create `path` (and its parents) as directories; with include_last == 0 only
 * the parents.  New directories get mode/uid/gid.  On error returns -errno and
 * copies the failing path into `failed`. */
static int make_dirs(const char *path, mode_t mode, uid_t uid, gid_t gid, int include_last,
                     char *failed, size_t failed_len) {
    size_t len = strlen(path);
    char *buf = malloc(len + 1);
    if (!buf)
        return -ENOMEM;
    memcpy(buf, path, len + 1);
    size_t stop = len;
    if (!include_last) {
        while (stop > 0 && buf[stop - 1] == '/')
            stop--;
        while (stop > 0 && buf[stop - 1] != '/')
            stop--;
    }
    int rc = 0;
    for (size_t i = 1; i <= stop && rc == 0; i++) {
        if (i < stop && buf[i] != '/')
            continue;
        if (buf[i - 1] == '/')
            continue; /* empty component or the root */
        char saved = buf[i];
        buf[i] = 0;
        if (mkdir(buf, 0700) == 0) {
            if (chown(buf, uid, gid) < 0 || chmod(buf, mode) < 0)
                rc = -errno;
        } else if (errno == EEXIST) {
            struct stat st;
            if (stat(buf, &st) < 0)
                rc = -errno;
            else if (!S_ISDIR(st.st_mode))
                rc = -ENOTDIR;
        } else {
            rc = -errno;
        }
        if (rc)
            snprintf(failed, failed_len, "%s", buf);
        buf[i] = saved;
    }
    free(buf);
    return rc;
}

static void do_read(const unsigned char *pl, uint32_t plen) {
    struct cur c = {pl, plen, 0};
    uint64_t max = get_u64(&c);
    const char *path = get_str(&c);
    if (c.bad) {
        send_err(EINVAL, "read: malformed request");
        return;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    if (fd < 0) {
        send_err(errno, "open %s: %s", path, strerror(errno));
        return;
    }
    struct stat st;
    if (fstat(fd, &st) < 0) {
        send_err(errno, "stat %s: %s", path, strerror(errno));
        return;
    }
    if (S_ISDIR(st.st_mode)) {
        send_err(EISDIR, "read %s: %s", path, strerror(EISDIR));
        return;
    }
    if (S_ISREG(st.st_mode) && (uint64_t)st.st_size > max) {
        send_err(EFBIG, "read %s: file is %lld bytes, limit is %llu bytes", path,
                 (long long)st.st_size, (unsigned long long)max);
        return;
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0)
        fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    unsigned char *buf = malloc(FILE_CHUNK);
    if (!buf) {
        send_err(ENOMEM, "read %s: out of memory", path);
        return;
    }
    send_stat(path, &st, "");
    uint64_t total = 0;
    for (;;) {
        ssize_t n = read(fd, buf, FILE_CHUNK);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            send_err(errno, "read %s: %s", path, strerror(errno));
            return;
        }
        if (n == 0)
            break;
        total += (uint64_t)n;
        if (total > max) {
            send_err(EFBIG, "read %s: more than %llu bytes", path, (unsigned long long)max);
            return;
        }
        send_frame('D', buf, (size_t)n);
    }
    send_ok(NULL, 0);
}

static void do_write(const unsigned char *pl, uint32_t plen) {
    struct cur c = {pl, plen, 0};
    uint32_t mode = get_u32(&c), uid = get_u32(&c), gid = get_u32(&c), flags = get_u32(&c);
    const char *rpath = get_str(&c);
    int err = 0;
    char msg[1024] = "";
    const char *path = rpath;
    char *tmp = NULL;
    int fd = -1, created = 1;
    uint64_t total = 0;
    if (c.bad) {
        err = EINVAL;
        snprintf(msg, sizeof(msg), "write: malformed request");
        goto drain;
    }
    const char *slash = strrchr(path, '/');
    const char *base = slash ? slash + 1 : path;
    if (!*base) {
        err = EISDIR;
        snprintf(msg, sizeof(msg), "write %s: %s", path, strerror(err));
        goto drain;
    }
    if (flags & WRITE_MKDIRS) {
        char failed[512];
        int rc = make_dirs(path, 0755, uid, gid, 0, failed, sizeof(failed));
        if (rc) {
            err = -rc;
            snprintf(msg, sizeof(msg), "mkdir %s: %s", failed, strerror(err));
            goto drain;
        }
    }
    if (flags & WRITE_APPEND) {
        fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_EXCL | O_CLOEXEC | O_NOCTTY, 0600);
        if (fd < 0 && errno == EEXIST) {
            created = 0;
            fd = open(path, O_WRONLY | O_APPEND | O_CLOEXEC | O_NOCTTY);
        }
        if (fd < 0) {
            err = errno;
            snprintf(msg, sizeof(msg), "open %s: %s", path, strerror(err));
            goto drain;
        }
    } else {
        size_t dlen = (size_t)(base - path);
        tmp = malloc(dlen + strlen(base) + 32);
        if (!tmp) {
            err = ENOMEM;
            snprintf(msg, sizeof(msg), "write %s: out of memory", path);
            goto drain;
        }
        sprintf(tmp, "%.*s.%s.shoal-XXXXXX", (int)dlen, path, base);
        fd = mkostemp(tmp, O_CLOEXEC);
        if (fd < 0) {
            err = errno;
            snprintf(msg, sizeof(msg), "open %s: %s", path, strerror(err));
            free(tmp);
            tmp = NULL;
            goto drain;
        }
    }
drain:
    for (;;) {
        char type;
        unsigned char *p;
        uint32_t n;
        if (!read_frame(&type, &p, &n)) {
            if (tmp)
                unlink(tmp);
            _exit(1);
        }
        if (type == 'C')
            break;
        if (type != 'D') {
            if (!err) {
                err = EPROTO;
                snprintf(msg, sizeof(msg), "write %s: unexpected frame type %d", path, type);
            }
            continue;
        }
        if (err)
            continue;
        while (n > 0) {
            ssize_t w = write(fd, p, n);
            if (w < 0) {
                if (errno == EINTR)
                    continue;
                err = errno;
                snprintf(msg, sizeof(msg), "write %s: %s", path, strerror(err));
                break;
            }
            p += w;
            n -= (uint32_t)w;
            total += (uint64_t)w;
        }
    }
    if (!err && created && (fchown(fd, uid, gid) < 0 || fchmod(fd, mode & 07777) < 0)) {
        err = errno;
        snprintf(msg, sizeof(msg), "chown/chmod %s: %s", path, strerror(err));
    }
    if (fd >= 0 && close(fd) < 0 && !err) {
        err = errno;
        snprintf(msg, sizeof(msg), "write %s: %s", path, strerror(err));
    }
    if (!err && tmp && rename(tmp, path) < 0) {
        err = errno;
        snprintf(msg, sizeof(msg), "rename %s: %s", path, strerror(err));
    }
    if (err) {
        if (tmp)
            unlink(tmp);
        send_err(err, "%s", msg);
        return;
    }
    unsigned char out[8];
    put_u64(out, total);
    send_ok(out, 8);
}

/* ------------------------------------------------------------------------ */
/* Untar: a directory tree uploaded as one tar stream ('T').                 */
/*                                                                           */
/* Request: u32 uid, u32 gid, target path; then 'D' frames of a tar stream   */
/* (ustar or GNU, long names via 'L'/'K'), then 'C'.  Reply: 'A' u64 count of */
/* entries made, or 'Z'.  The handler first becomes the sandbox user, so the */
/* kernel applies that user's permissions.  Members with an absolute name or */
/* a '..' component are refused; every directory on a member's way is opened */
/* with O_NOFOLLOW (a link already in the tree is never followed), and a     */
/* file or link replaces whatever entry had its name.                        */

struct untar {
    int root;                /* the target directory */
    unsigned char hdr[512];
    size_t hlen;
    uint64_t left, pad;      /* data bytes of the member still to come, then padding */
    int kind;                /* what the data is: 0 skipped, 1 file, 2 long name, 3 long link */
    int fd;
    char *lname, *llink;     /* pending GNU long name / link target */
    size_t lbuf_len;
    char *lbuf;
    uint64_t count;
    int done, err;
    char msg[1024];
};

#define UNTAR_LONG_MAX 65536

static uint64_t tar_num(const unsigned char *f, size_t n) {
    if (f[0] & 0x80) { /* GNU base-256 */
        uint64_t v = f[0] & 0x3f;
        for (size_t i = 1; i < n; i++)
            v = (v << 8) | f[i];
        return v;
    }
    uint64_t v = 0;
    size_t i = 0;
    while (i < n && (f[i] == ' ' || f[i] == 0))
        i++;
    for (; i < n && f[i] >= '0' && f[i] <= '7'; i++)
        v = (v << 3) | (uint64_t)(f[i] - '0');
    return v;
}

static void untar_fail(struct untar *u, int err, const char *fmt, ...) {
    if (u->err)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(u->msg, sizeof(u->msg), fmt, ap);
    va_end(ap);
    u->err = err ? err : EINVAL;
}

/* The directory that holds member `name` (made if missing, never through a link) and its last component
 * in `leaf` (empty for the target itself); -1 on error (recorded in u). */
static int untar_parent(struct untar *u, const char *name, char *leaf, size_t leaf_len) {
    if (name[0] == '/') {
        untar_fail(u, EPERM, "untar: member %s has an absolute name; upload relative names only", name);
        return -1;
    }
    char *copy = strdup(name);
    if (!copy) {
        untar_fail(u, ENOMEM, "untar: out of memory");
        return -1;
    }
    char *parts[4096];
    size_t np = 0;
    for (char *save = NULL, *t = strtok_r(copy, "/", &save); t; t = strtok_r(NULL, "/", &save)) {
        if (strcmp(t, ".") == 0)
            continue;
        if (strcmp(t, "..") == 0 || np == sizeof(parts) / sizeof(parts[0])) {
            untar_fail(u, EPERM, "untar: member %s leads out of the target ('..'); refused", name);
            free(copy);
            return -1;
        }
        parts[np++] = t;
    }
    snprintf(leaf, leaf_len, "%s", np ? parts[np - 1] : "");
    int dir = dup(u->root);
    for (size_t i = 0; dir >= 0 && i + 1 < np; i++) {
        int next = openat(dir, parts[i], O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (next < 0 && errno == ENOENT) {
            if (mkdirat(dir, parts[i], 0755) < 0 && errno != EEXIST) {
                untar_fail(u, errno, "untar: mkdir for member %s: %s", name, strerror(errno));
                close(dir);
                dir = -1;
                break;
            }
            next = openat(dir, parts[i], O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        }
        if (next < 0) {
            int e = errno;
            untar_fail(u, e == ELOOP ? ENOTDIR : e, "untar: member %s: %s on its way is %s", name, parts[i],
                       e == ELOOP || e == ENOTDIR ? "not a directory (links are not followed)" : strerror(e));
        }
        close(dir);
        dir = next;
    }
    free(copy);
    return dir;
}

static void untar_member(struct untar *u) {
    const unsigned char *h = u->hdr;
    uint64_t size = tar_num(h + 124, 12);
    char type = (char)h[156];
    u->left = size;
    u->pad = (512 - size % 512) % 512;
    u->kind = 0;
    if (type == 'L' || type == 'K') {
        if (size > UNTAR_LONG_MAX) {
            untar_fail(u, ENAMETOOLONG, "untar: a long name of %llu bytes", (unsigned long long)size);
            return;
        }
        free(u->lbuf);
        u->lbuf = calloc(1, (size_t)size + 1);
        u->lbuf_len = 0;
        if (!u->lbuf) {
            untar_fail(u, ENOMEM, "untar: out of memory");
            return;
        }
        u->kind = type == 'L' ? 2 : 3;
        return;
    }
    char name[4096 + 256], link[4096 + 1];
    if (u->lname) {
        snprintf(name, sizeof(name), "%s", u->lname);
    } else if (memcmp(h + 257, "ustar\0", 6) == 0 && h[345]) {
        snprintf(name, sizeof(name), "%.155s/%.100s", (const char *)h + 345, (const char *)h);
    } else {
        snprintf(name, sizeof(name), "%.100s", (const char *)h);
    }
    if (u->llink)
        snprintf(link, sizeof(link), "%s", u->llink);
    else
        snprintf(link, sizeof(link), "%.100s", (const char *)h + 157);
    free(u->lname);
    free(u->llink);
    u->lname = u->llink = NULL;
    mode_t mode = (mode_t)tar_num(h + 100, 8) & 0777;
    if (type != '0' && type != '\0' && type != '7' && type != '5' && type != '2') {
        untar_fail(u, EINVAL, "untar: member %s is of type '%c', which uploads do not make (files, "
                   "directories and symlinks only; pax headers are not read: use the GNU format)", name, type);
        return;
    }
    char leaf[4096];
    int dir = untar_parent(u, name, leaf, sizeof(leaf));
    if (dir < 0)
        return;
    if (!leaf[0]) { /* the target itself */
        if (type != '5')
            untar_fail(u, EISDIR, "untar: member %s names the target directory", name);
        close(dir);
        return;
    }
    if (type == '5') {
        if (mkdirat(dir, leaf, mode | 0700) < 0) {
            struct stat st;
            if (errno != EEXIST || fstatat(dir, leaf, &st, AT_SYMLINK_NOFOLLOW) < 0 || !S_ISDIR(st.st_mode))
                untar_fail(u, errno == EEXIST ? ENOTDIR : errno, "untar: directory %s: %s", name,
                           errno == EEXIST ? "exists and is not a directory" : strerror(errno));
        }
    } else {
        if (unlinkat(dir, leaf, 0) < 0 && errno != ENOENT && errno != EISDIR) {
            untar_fail(u, errno, "untar: replace %s: %s", name, strerror(errno));
        } else if (type == '2') {
            if (symlinkat(link, dir, leaf) < 0)
                untar_fail(u, errno, "untar: symlink %s: %s", name, strerror(errno));
        } else {
            u->fd = openat(dir, leaf, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY, 0600);
            if (u->fd < 0 || fchmod(u->fd, mode) < 0)
                untar_fail(u, errno, "untar: create %s: %s", name, strerror(errno));
            else
                u->kind = 1;
        }
    }
    close(dir);
    if (!u->err)
        u->count++;
}

static void untar_feed(struct untar *u, const unsigned char *p, size_t n) {
    while (n > 0 && !u->err && !u->done) {
        if (u->left) {
            size_t take = u->left < n ? (size_t)u->left : n;
            if (u->kind == 1) {
                for (size_t off = 0; off < take;) {
                    ssize_t w = write(u->fd, p + off, take - off);
                    if (w < 0 && errno == EINTR)
                        continue;
                    if (w < 0) {
                        untar_fail(u, errno, "untar: write: %s", strerror(errno));
                        return;
                    }
                    off += (size_t)w;
                }
            } else if (u->kind >= 2) {
                memcpy(u->lbuf + u->lbuf_len, p, take);
                u->lbuf_len += take;
            }
            u->left -= take;
            p += take;
            n -= take;
            if (u->left == 0) {
                if (u->kind == 1) {
                    close(u->fd);
                    u->fd = -1;
                } else if (u->kind >= 2) {
                    char **slot = u->kind == 2 ? &u->lname : &u->llink;
                    free(*slot);
                    *slot = u->lbuf;
                    u->lbuf = NULL;
                }
                u->kind = 0;
            }
            continue;
        }
        if (u->pad) {
            size_t take = u->pad < n ? (size_t)u->pad : n;
            u->pad -= take;
            p += take;
            n -= take;
            continue;
        }
        size_t take = 512 - u->hlen < n ? 512 - u->hlen : n;
        memcpy(u->hdr + u->hlen, p, take);
        u->hlen += take;
        p += take;
        n -= take;
        if (u->hlen < 512)
            continue;
        u->hlen = 0;
        uint64_t sum = 0;
        int zero = 1;
        for (int i = 0; i < 512; i++) {
            sum += (i >= 148 && i < 156) ? ' ' : u->hdr[i];
            zero &= u->hdr[i] == 0;
        }
        if (zero) { /* the end-of-archive blocks */
            u->done = 1;
            return;
        }
        if (sum != tar_num(u->hdr + 148, 8)) {
            untar_fail(u, EINVAL, "untar: not a tar stream (bad header checksum after %llu entries)",
                       (unsigned long long)u->count);
            return;
        }
        untar_member(u);
    }
}

static void do_untar(const unsigned char *pl, uint32_t plen) {
    struct cur c = {pl, plen, 0};
    uint32_t uid = get_u32(&c), gid = get_u32(&c);
    const char *path = get_str(&c);
    struct untar u;
    memset(&u, 0, sizeof(u));
    u.root = u.fd = -1;
    if (c.bad) {
        untar_fail(&u, EINVAL, "untar: malformed request");
    } else if (uid != (uint32_t)geteuid() || gid != (uint32_t)getegid()) {
        if ((setgroups(0, NULL) < 0 && errno != EPERM) || setgid((gid_t)gid) < 0 || setuid((uid_t)uid) < 0)
            untar_fail(&u, errno, "untar: cannot become %u:%u: %s", uid, gid, strerror(errno));
    }
    if (!u.err) {
        char failed[512];
        int rc = make_dirs(path, 0755, uid, gid, 1, failed, sizeof(failed));
        if (rc)
            untar_fail(&u, -rc, "mkdir %s: %s", failed, strerror(-rc));
        else if ((u.root = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0)
            untar_fail(&u, errno, "open %s: %s", path, strerror(errno));
    }
    for (;;) {
        char type;
        unsigned char *p;
        uint32_t n;
        if (!read_frame(&type, &p, &n))
            _exit(1);
        if (type == 'C')
            break;
        if (type == 'D')
            untar_feed(&u, p, n);
        else
            untar_fail(&u, EPROTO, "untar: unexpected frame type %d", type);
    }
    if (!u.err && !u.done && (u.left || u.hlen || u.kind))
        untar_fail(&u, EINVAL, "untar: the tar stream ended inside a member");
    if (u.fd >= 0)
        close(u.fd);
    if (u.root >= 0)
        close(u.root);
    free(u.lname);
    free(u.llink);
    free(u.lbuf);
    if (u.err) {
        send_err(u.err, "%s", u.msg);
        return;
    }
    unsigned char out[8];
    put_u64(out, u.count);
    send_ok(out, 8);
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Read all names of a directory (sorted, without . and ..); closes nothing. */
static char **read_names(DIR *d, size_t *count) {
    size_t cap = 32, n = 0;
    char **names = malloc(cap * sizeof(char *));
    struct dirent *e;
    while (names && (e = readdir(d))) {
        if (e->d_name[0] == '.' && (!e->d_name[1] || (e->d_name[1] == '.' && !e->d_name[2])))
            continue;
        if (n == cap) {
            cap *= 2;
            char **nn = realloc(names, cap * sizeof(char *));
            if (!nn)
                break;
            names = nn;
        }
        names[n] = strdup(e->d_name);
        if (names[n])
            n++;
    }
    if (names)
        qsort(names, n, sizeof(char *), cmp_str);
    *count = n;
    return names;
}

static void free_names(char **names, size_t n) {
    for (size_t i = 0; i < n; i++)
        free(names[i]);
    free(names);
}

static void list_dir(int dfd, const char *prefix, int recursive) {
    DIR *d = fdopendir(dfd);
    if (!d) {
        close(dfd);
        return;
    }
    size_t n;
    char **names = read_names(d, &n);
    for (size_t i = 0; names && i < n; i++) {
        struct stat st;
        if (fstatat(dfd, names[i], &st, AT_SYMLINK_NOFOLLOW) < 0)
            continue;
        char *rel = names[i];
        char *owned = NULL;
        if (*prefix) {
            owned = malloc(strlen(prefix) + strlen(names[i]) + 2);
            if (!owned)
                continue;
            sprintf(owned, "%s/%s", prefix, names[i]);
            rel = owned;
        }
        char target[PATH_MAX] = "";
        if (S_ISLNK(st.st_mode)) {
            ssize_t tl = readlinkat(dfd, names[i], target, sizeof(target) - 1);
            target[tl > 0 ? tl : 0] = 0;
        }
        send_stat(rel, &st, target);
        if (recursive && S_ISDIR(st.st_mode)) {
            int sub = openat(dfd, names[i], O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            if (sub >= 0)
                list_dir(sub, rel, 1);
        }
        free(owned);
    }
    if (names)
        free_names(names, n);
    closedir(d);
}

static void do_list(const unsigned char *pl, uint32_t plen) {
    struct cur c = {pl, plen, 0};
    int recursive = get_u8(&c);
    const char *path = get_str(&c);
    if (c.bad) {
        send_err(EINVAL, "list: malformed request");
        return;
    }
    struct stat st;
    if (stat(path, &st) < 0) {
        send_err(errno, "list %s: %s", path, strerror(errno));
        return;
    }
    if (!S_ISDIR(st.st_mode)) {
        send_err(ENOTDIR, "list %s: %s", path, strerror(ENOTDIR));
        return;
    }
    int dfd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) {
        send_err(errno, "list %s: %s", path, strerror(errno));
        return;
    }
    list_dir(dfd, "", recursive);
    send_ok(NULL, 0);
}

static void do_stat(const unsigned char *pl, uint32_t plen) {
    struct cur c = {pl, plen, 0};
    const char *path = get_str(&c);
    if (c.bad) {
        send_err(EINVAL, "stat: malformed request");
        return;
    }
    struct stat st;
    if (lstat(path, &st) < 0) {
        send_err(errno, "stat %s: %s", path, strerror(errno));
        return;
    }
    char target[PATH_MAX] = "";
    if (S_ISLNK(st.st_mode)) {
        ssize_t tl = readlink(path, target, sizeof(target) - 1);
        target[tl > 0 ? tl : 0] = 0;
    }
    send_stat(path, &st, target);
    send_ok(NULL, 0);
}

static void do_mkdir(const unsigned char *pl, uint32_t plen) {
    struct cur c = {pl, plen, 0};
    uint32_t mode = get_u32(&c), uid = get_u32(&c), gid = get_u32(&c);
    int parents = get_u8(&c);
    const char *path = get_str(&c);
    if (c.bad) {
        send_err(EINVAL, "mkdir: malformed request");
        return;
    }
    if (parents) {
        char failed[512];
        int rc = make_dirs(path, mode & 07777, uid, gid, 1, failed, sizeof(failed));
        if (rc) {
            send_err(-rc, "mkdir %s: %s", failed, strerror(-rc));
            return;
        }
    } else {
        if (mkdir(path, 0700) < 0 || chown(path, uid, gid) < 0 || chmod(path, mode & 07777) < 0) {
            send_err(errno, "mkdir %s: %s", path, strerror(errno));
            return;
        }
    }
    send_ok(NULL, 0);
}

/* Remove directory `name` under dfd and everything in it; never follows
 * symlinks.  Returns 0 or -errno (first failure). */
static int remove_tree(int dfd, const char *name, char *failed, size_t failed_len) {
    int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        snprintf(failed, failed_len, "%s", name);
        return -errno;
    }
    DIR *d = fdopendir(fd);
    if (!d) {
        close(fd);
        return -errno;
    }
    size_t n;
    char **names = read_names(d, &n);
    int rc = names ? 0 : -ENOMEM;
    for (size_t i = 0; names && i < n && rc == 0; i++) {
        struct stat st;
        if (fstatat(fd, names[i], &st, AT_SYMLINK_NOFOLLOW) < 0) {
            if (errno != ENOENT)
                rc = -errno;
        } else if (S_ISDIR(st.st_mode)) {
            rc = remove_tree(fd, names[i], failed, failed_len);
        } else if (unlinkat(fd, names[i], 0) < 0 && errno != ENOENT) {
            rc = -errno;
        }
        if (rc && !*failed)
            snprintf(failed, failed_len, "%s", names[i]);
    }
    if (names)
        free_names(names, n);
    closedir(d);
    if (rc == 0 && unlinkat(dfd, name, AT_REMOVEDIR) < 0) {
        rc = -errno;
        snprintf(failed, failed_len, "%s", name);
    }
    return rc;
}

static void do_remove(const unsigned char *pl, uint32_t plen) {
    struct cur c = {pl, plen, 0};
    int recursive = get_u8(&c);
    const char *path = get_str(&c);
    if (c.bad) {
        send_err(EINVAL, "remove: malformed request");
        return;
    }
    struct stat st;
    if (lstat(path, &st) < 0) {
        send_err(errno, "remove %s: %s", path, strerror(errno));
        return;
    }
    if (S_ISDIR(st.st_mode)) {
        if (recursive) {
            char failed[512] = "";
            int rc = remove_tree(AT_FDCWD, path, failed, sizeof(failed));
            if (rc) {
                send_err(-rc, "remove %s: %s (at %s)", path, strerror(-rc), failed);
                return;
            }
        } else if (rmdir(path) < 0) {
            send_err(errno, "remove %s: %s", path, strerror(errno));
            return;
        }
    } else if (unlink(path) < 0) {
        send_err(errno, "remove %s: %s", path, strerror(errno));
        return;
    }
    send_ok(NULL, 0);
}

/* Main, VMs: mount cgroup2 if the guest has not (a microvm's init does not), enable pids for the root's
 * children and make the commands' cgroup (no limit until the node sends one). Without it, commands run
 * unbounded and 'I' with a pids limit fails, naming why. */
static void setup_commands_cgroup(void) {
    struct stat st;
    if (stat(CGROUP_ROOT "/cgroup.controllers", &st) < 0) {
        mkdir(CGROUP_ROOT, 0755);
        if (mount("cgroup2", CGROUP_ROOT, "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0) {
            fprintf(stderr, "shoal-agent: mount cgroup2: %s (no pids limit for commands)\n", strerror(errno));
            return;
        }
    }
    int fd = open(CGROUP_ROOT "/cgroup.subtree_control", O_WRONLY | O_CLOEXEC);
    if (fd < 0 || write(fd, "+pids", 5) != 5)
        fprintf(stderr, "shoal-agent: enabling the pids controller: %s\n", strerror(errno));
    if (fd >= 0)
        close(fd);
    if (mkdir(COMMANDS_CGROUP, 0755) < 0 && errno != EEXIST) {
        fprintf(stderr, "shoal-agent: mkdir %s: %s\n", COMMANDS_CGROUP, strerror(errno));
        return;
    }
    commands_cgroup = open(COMMANDS_CGROUP, O_PATH | O_DIRECTORY | O_CLOEXEC);
}

/* The commands' pids.max: `limit` processes, 0 for none. */
static int set_pids_limit(uint32_t limit) {
    if (commands_cgroup < 0) {
        send_err(ENOTSUP, "the guest has no cgroup for commands (cgroup2 with pids is needed for a pids limit)");
        return -1;
    }
    char text[16];
    int len = limit ? snprintf(text, sizeof(text), "%u", limit) : snprintf(text, sizeof(text), "max");
    int fd = openat(commands_cgroup, "pids.max", O_WRONLY | O_CLOEXEC);
    if (fd < 0 || write(fd, text, (size_t)len) != len) {
        send_err(errno, "setting the guest's pids limit to %s: %s", text, strerror(errno));
        if (fd >= 0)
            close(fd);
        return -1;
    }
    close(fd);
    return 0;
}

/* Leave `cap_mb` MiB free on the root file system for the sandbox to write (0: no cap, give the space back):
 * a preallocated hold takes the rest, and the root is remounted with `discard` so what the sandbox deletes
 * is given back to the host too (QEMU's drive has discard=unmap), keeping the host's qcow2 near the cap. */
static int set_disk_cap(uint32_t cap_mb) {
/* Without a cap, removing an earlier hold (a snapshot of a capped sandbox) is best effort: no error frame. */
#define CAP_FAIL(...)                                                                                          \
    do {                                                                                                       \
        if (cap_mb)                                                                                            \
            send_err(errno, __VA_ARGS__);                                                                      \
        goto out;                                                                                              \
    } while (0)
    int rc = cap_mb ? -1 : 0, fd = -1, dir = -1, bound = 0;
    mkdir(DISK_HOLD_DIR, 0700);
    if (mount("/", DISK_HOLD_DIR, NULL, MS_BIND, NULL) < 0)
        CAP_FAIL("disk cap: bind-mounting / at %s: %s", DISK_HOLD_DIR, strerror(errno));
    bound = 1;
    dir = open(DISK_HOLD_DIR, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (dir < 0)
        CAP_FAIL("disk cap: open %s: %s", DISK_HOLD_DIR, strerror(errno));
    if (!cap_mb) {
        unlinkat(dir, DISK_HOLD_FILE, 0);
        goto out;
    }
    mkdirat(dir, ".shoal", 0755);
    fd = openat(dir, DISK_HOLD_FILE, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0);
    if (fd < 0 || ftruncate(fd, 0) < 0 || fsync(fd) < 0) /* fsync: an earlier hold's blocks are free again */
        CAP_FAIL("disk cap: %s: %s", DISK_HOLD_FILE, strerror(errno));
    struct statvfs vfs;
    if (fstatvfs(fd, &vfs) < 0)
        CAP_FAIL("disk cap: statvfs /: %s", strerror(errno));
    /* f_bavail: what is left past ext4's own reserve (and root's, none on shoal's disks: mkfs -m 0) */
    uint64_t free_bytes = (uint64_t)vfs.f_bavail * vfs.f_frsize, cap = (uint64_t)cap_mb << 20;
    if (free_bytes > cap && fallocate(fd, 0, 0, (off_t)(free_bytes - cap)) < 0)
        CAP_FAIL("disk cap: reserving %llu MiB: %s", (unsigned long long)((free_bytes - cap) >> 20), strerror(errno));
    if (fsync(fd) < 0)
        CAP_FAIL("disk cap: fsync: %s", strerror(errno));
    unsigned long keep = vfs.f_flag & (ST_RDONLY | ST_NOSUID | ST_NODEV | ST_NOEXEC | ST_SYNCHRONOUS | ST_NOATIME |
                                       ST_NODIRATIME | ST_RELATIME);
    if (mount(NULL, "/", NULL, MS_REMOUNT | keep, "discard") < 0)
        CAP_FAIL("disk cap: remounting / with discard: %s", strerror(errno));
    rc = 0;
out:
    if (fd >= 0)
        close(fd);
    if (dir >= 0)
        close(dir);
    if (bound)
        umount2(DISK_HOLD_DIR, MNT_DETACH);
    rmdir(DISK_HOLD_DIR);
    return rc;
#undef CAP_FAIL
}

/* 'I' (VMs, after a boot, restore or fork): str hostname, str machine_id, u64 realtime_ns, u32 pids (0: no
 * limit), u32 disk_mb (0: no cap), seed bytes. Gives the copy its own identity (hostname, /etc/machine-id,
 * entropy pool, wall clock) and the sandbox's limits, which the template it was restored from cannot know. */
static void do_identity(const unsigned char *pl, uint32_t plen) {
    struct cur c = {pl, plen, 0};
    const char *host = get_str(&c);
    const char *mid = get_str(&c);
    uint64_t now = get_u64(&c);
    uint32_t pids = get_u32(&c), disk_mb = get_u32(&c);
    if (c.bad) {
        send_err(EINVAL, "malformed identity request");
        return;
    }
    if ((pids || commands_cgroup >= 0) && set_pids_limit(pids) < 0)
        return;
    if (set_disk_cap(disk_mb) < 0)
        return;
    if (*host && sethostname(host, strlen(host)) < 0) {
        send_err(errno, "sethostname: %s", strerror(errno));
        return;
    }
    if (*mid) {
        int fd = open("/etc/machine-id", O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0444);
        if (fd >= 0) {
            dprintf(fd, "%s\n", mid);
            close(fd);
        }
    }
    if (now) {
        struct timespec ts = {(time_t)(now / 1000000000ULL), (long)(now % 1000000000ULL)};
        clock_settime(CLOCK_REALTIME, &ts);
    }
    if (c.n > 0 && c.n <= 512) {
        struct {
            int entropy_count;
            int buf_size;
            unsigned char buf[512];
        } ent;
        ent.entropy_count = (int)c.n * 8;
        ent.buf_size = (int)c.n;
        memcpy(ent.buf, c.p, c.n);
        int fd = open("/dev/urandom", O_WRONLY | O_CLOEXEC);
        if (fd >= 0) {
            if (ioctl(fd, RNDADDENTROPY, &ent) < 0 && write(fd, c.p, c.n) < 0) {
                /* best effort: nothing more to do */
            }
            /* Mixing entropy in does not rekey the kernel's CRNG at once: copies restored from one
               snapshot would keep reading the same /dev/urandom stream until its next periodic reseed. */
            if (ioctl(fd, RNDRESEEDCRNG) < 0) {
                send_err(errno, "reseeding the kernel's random number generator failed: %s", strerror(errno));
                close(fd);
                return;
            }
            close(fd);
        }
    }
    send_ok(NULL, 0);
}

/* ------------------------------------------------------------------------ */
/* Main                                                                      */

static void send_hello(void) {
    unsigned char out[4 + sizeof(AGENT_VERSION)];
    put_u32(out, (uint32_t)agent_pid);
    memcpy(out + 4, AGENT_VERSION, sizeof(AGENT_VERSION) - 1);
    send_ok(out, 4 + sizeof(AGENT_VERSION) - 1);
}

/* ------------------------------------------------------------------------ */
/* The reserve: one pre-forked process that serves hello, process lists and  */
/* kills on connections main could not fork a handler for (the sandbox's     */
/* pids limit is exhausted, e.g. by a fork bomb), so the node can still       */
/* clean the sandbox up.  Main passes it such connections over a socketpair  */
/* (SCM_RIGHTS) and forks a new reserve whenever the old one is gone.         */

static int reserve_sock[2] = {-1, -1}; /* [0] main's end, [1] the reserve's */
static pid_t reserve_pid = 0;

static int reserve_alive(void) { return reserve_pid > 0 && slot_kind(reserve_pid) == SLOT_RESERVE; }

static void close_fds_except(int keep) {
    DIR *d = opendir("/proc/self/fd");
    if (!d)
        return;
    int fds[1024], n = 0, dfd = dirfd(d);
    struct dirent *e;
    while ((e = readdir(d)) && n < 1024) {
        int fd = atoi(e->d_name);
        if (e->d_name[0] >= '0' && e->d_name[0] <= '9' && fd > 2 && fd != keep && fd != dfd)
            fds[n++] = fd;
    }
    closedir(d);
    for (int i = 0; i < n; i++)
        close(fds[i]);
}

static void reserve_loop(void) {
    in_reserve = 1;
    prctl(PR_SET_NAME, "shoal-reserve");
    prctl(PR_SET_PDEATHSIG, SIGKILL); /* main gone (outside a PID namespace): go too */
    for (;;) {
        char dummy;
        struct iovec iov = {&dummy, 1};
        union {
            struct cmsghdr h;
            char buf[CMSG_SPACE(sizeof(int))];
        } u;
        struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof(u.buf)};
        ssize_t r = recvmsg(reserve_sock[1], &msg, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            _exit(0); /* main is gone */
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        if (!c || c->cmsg_type != SCM_RIGHTS)
            continue;
        int fd;
        memcpy(&fd, CMSG_DATA(c), sizeof(fd));
        struct timeval tv = {5, 0}; /* a silent or stalled client cannot hold the reserve */
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
        conn = fd;
        ilen = ipos = olen = 0;
        if (sigsetjmp(reserve_jmp, 1) == 0) {
            char type;
            unsigned char *p;
            uint32_t n;
            if (read_frame(&type, &p, &n)) {
                if (type == 'H')
                    send_hello();
                else if (type == 'Q')
                    do_list_procs();
                else if (type == 'K')
                    do_kill_procs(p, n);
                else
                    send_err(EAGAIN, "the agent could not fork a handler: %s (the sandbox is at its pids limit: "
                                     "kill its processes (kill_processes), or create it with a larger pids)",
                             strerror(EAGAIN));
            }
        }
        close(fd);
        conn = -1;
        ilen = ipos = olen = 0;
    }
}

/* Start a reserve if there is none (quietly fails while the pids limit is exhausted; tried again later). */
static void ensure_reserve(void) {
    if (reserve_alive())
        return;
    if (reserve_sock[0] < 0 && socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, reserve_sock) < 0)
        return;
    pid_t pid = agent_fork(SLOT_RESERVE);
    if (pid == 0) {
        struct sigaction sa;
        memset(&sa, 0, sizeof(sa));
        sa.sa_handler = SIG_DFL;
        sigaction(SIGCHLD, &sa, NULL);
        sigaction(SIGTERM, &sa, NULL);
        sigaction(SIGINT, &sa, NULL);
        close_fds_except(reserve_sock[1]);
        reserve_loop();
    }
    if (pid > 0)
        reserve_pid = pid;
}

/* Hand connection `fd` to the reserve; 0 if it took it. */
static int pass_to_reserve(int fd) {
    if (!reserve_alive())
        return -1;
    char dummy = 0;
    struct iovec iov = {&dummy, 1};
    union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(sizeof(int))];
    } u;
    memset(&u, 0, sizeof(u));
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof(u.buf)};
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof(fd));
    return sendmsg(reserve_sock[0], &msg, MSG_DONTWAIT | MSG_NOSIGNAL) == 1 ? 0 : -1;
}

/* ------------------------------------------------------------------------ */
/* Port relay: 'F' u32 port.  The handler connects to 127.0.0.1:port (then     */
/* [::1]:port) inside the sandbox, answers 'A' (or 'Z' with the errno) and    */
/* from then on the connection carries raw bytes both ways until both sides  */
/* have closed.  The sandbox's network policy is not involved: the bytes go  */
/* over the agent's own channel (a Unix socket, or the VM's serial mux), so  */
/* a sandbox with network="none" can serve a port to the node.               */

#define RELAY_BUF (64u << 10)

static void do_forward(const unsigned char *pl, uint32_t plen) {
    struct cur c = {pl, plen, 0};
    uint32_t port = get_u32(&c);
    if (c.bad || port == 0 || port > 65535) {
        send_err(EINVAL, "forward: malformed request (port 1-65535)");
        return;
    }
    int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a4 = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a4.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int err = 0;
    if (s < 0 || connect(s, (struct sockaddr *)&a4, sizeof(a4)) < 0) {
        err = errno;
        if (s >= 0)
            close(s);
        s = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_in6 a6 = {.sin6_family = AF_INET6, .sin6_port = htons((uint16_t)port)};
        a6.sin6_addr = in6addr_loopback;
        if (s < 0 || connect(s, (struct sockaddr *)&a6, sizeof(a6)) < 0) {
            if (s >= 0)
                close(s);
            send_err(err, "nothing accepts connections on port %u in the sandbox: %s", port, strerror(err));
            return;
        }
    }
    int one = 1;
    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    send_ok(NULL, 0);
    /* bytes the client sent after the request (it should wait for 'A', but may not) go first */
    unsigned char *buf[2] = {malloc(RELAY_BUF), malloc(RELAY_BUF)};
    size_t len[2] = {0, 0}, off[2] = {0, 0}; /* [0] client -> port, [1] port -> client */
    int eof[2] = {0, 0};
    if (!buf[0] || !buf[1])
        _exit(1);
    if (ilen > ipos) {
        size_t n = ilen - ipos < RELAY_BUF ? ilen - ipos : RELAY_BUF;
        memcpy(buf[0], ibuf + ipos, n);
        len[0] = n;
        ipos += n;
    }
    int fds[2] = {conn, s};
    for (;;) {
        struct pollfd p[2];
        for (int d = 0; d < 2; d++) { /* direction d reads fds[d], writes fds[1 - d] */
            p[d].fd = fds[d];
            p[d].events = 0;
        }
        for (int d = 0; d < 2; d++) {
            if (!eof[d] && len[d] == 0)
                p[d].events |= POLLIN;
            if (len[d] > off[d])
                p[1 - d].events |= POLLOUT;
        }
        if (eof[0] && eof[1] && len[0] == 0 && len[1] == 0)
            break;
        if (poll(p, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        for (int d = 0; d < 2; d++) {
            if (len[d] > off[d] && (p[1 - d].revents & (POLLOUT | POLLERR | POLLHUP))) {
                ssize_t n = send(fds[1 - d], buf[d] + off[d], len[d] - off[d], MSG_NOSIGNAL | MSG_DONTWAIT);
                if (n < 0 && errno != EINTR && errno != EAGAIN)
                    _exit(0); /* the other side is gone */
                if (n > 0)
                    off[d] += (size_t)n;
                if (off[d] == len[d]) {
                    off[d] = len[d] = 0;
                    if (eof[d])
                        shutdown(fds[1 - d], SHUT_WR);
                }
            }
            if (!eof[d] && len[d] == 0 && (p[d].revents & (POLLIN | POLLHUP | POLLERR))) {
                ssize_t n = recv(fds[d], buf[d], RELAY_BUF, MSG_DONTWAIT);
                if (n > 0) {
                    len[d] = (size_t)n;
                } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
                    eof[d] = 1;
                    shutdown(fds[1 - d], SHUT_WR);
                }
            }
        }
    }
    close(s);
}
#include "procs.c" /* background processes and terminals: B, A, J */

/* The next exec request on a kept connection (a copy of its payload), skipping what the node sent the exec
 * that ended (stdin, a signal) after its exit frame; NULL once the node closed it or sent something else. */
static unsigned char *next_exec(uint32_t *len) {
    char type;
    unsigned char *p;
    uint32_t n;
    for (;;) {
        if (!read_frame(&type, &p, &n))
            return NULL;
        if (type == 'I' || type == 'C' || type == 'K')
            continue;
        if (type != 'E') {
            send_err(EINVAL, "only exec requests follow an exec on its connection, not 0x%02x", (unsigned char)type);
            return NULL;
        }
        unsigned char *req = malloc((size_t)n + 1);
        if (req) {
            memcpy(req, p, n);
            req[n] = 0;
            *len = n;
        }
        return req;
    }
}

static void handle(int fd) {
    conn = fd;
    prctl(PR_SET_CHILD_SUBREAPER, 1);
    char type;
    unsigned char *p;
    uint32_t n;
    if (!read_frame(&type, &p, &n))
        return;
    /* Keep the request payload: later frames may overwrite the input buffer. */
    unsigned char *req = malloc((size_t)n + 1);
    if (!req)
        return;
    memcpy(req, p, n);
    req[n] = 0;
    switch (type) {
    case 'H':
        send_hello();
        break;
    case 'E':
        while (do_exec(req, n)) { /* one fork per exec (the command's) while the node keeps the connection */
            free(req);
            if (!(req = next_exec(&n)))
                return;
        }
        break;
    case 'G':
        do_read(req, n);
        break;
    case 'W':
        do_write(req, n);
        break;
    case 'T':
        do_untar(req, n);
        break;
    case 'L':
        do_list(req, n);
        break;
    case 'S':
        do_stat(req, n);
        break;
    case 'M':
        do_mkdir(req, n);
        break;
    case 'U':
        do_remove(req, n);
        break;
    case 'I':
        do_identity(req, n);
        break;
    case 'Q':
        do_list_procs();
        break;
    case 'K':
        do_kill_procs(req, n);
        break;
    case 'F':
        do_forward(req, n);
        break;
    case 'B':
        do_background(req, n);
        break;
    case 'A':
        do_attach(req, n);
        break;
    case 'J':
        do_list_bg();
        break;
    default:
        send_err(EINVAL, "unknown request type 0x%02x", (unsigned char)type);
    }
}

/* ------------------------------------------------------------------------ */
/* Serial mode (VMs): one virtio-serial stream carries many connections.     */
/*                                                                           */
/* Mux frames both ways: u32 channel, u8 op, u32 length, payload.  Ops: 'O'  */
/* open (host -> guest), 'D' data, 'E' end of the sender's data (a half-    */
/* close: the other direction stays open), 'C' close, 'R' reset (host, first */
/* frame of every connection: earlier channels are stale).  A channel ends   */
/* with 'C' once both directions have ended (or either side is gone), so a   */
/* port relay keeps TCP's half-close as it does over a container's socket.   */
/* Each channel becomes a */
/* socketpair whose far end is served by an ordinary forked handler, so the  */
/* request protocol is byte for byte the one containers speak.  While the    */
/* host is away (restore, pause, node restart) the agent waits for it.       */

#define MUX_HDR 9
#define MUX_BUFFER_HIGH (64u << 20)

struct chan {
    uint32_t id;
    int fd;
    unsigned char *out;
    size_t len, cap;
    int host_eof;    /* the host sent 'E': shut our write side once `out` is flushed */
    int shut;        /* ... done */
    int handler_eof; /* the handler's side ended; 'E' sent to the host */
};

static struct chan *chans = NULL;
static size_t nchans = 0, chans_cap = 0;
static size_t mux_buffered = 0;

static void mux_write_all(int fd, const void *data, size_t len) {
    const unsigned char *p = data;
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return; /* host went away: poll will report the hangup */
        }
        p += n;
        len -= (size_t)n;
    }
}

static void mux_send(int serial, uint32_t ch, char op, const void *data, size_t len) {
    unsigned char hdr[MUX_HDR];
    put_u32(hdr, ch);
    hdr[4] = (unsigned char)op;
    put_u32(hdr + 5, (uint32_t)len);
    if (len == 0) {
        mux_write_all(serial, hdr, MUX_HDR);
        return;
    }
    unsigned char *frame = malloc(MUX_HDR + len);
    if (!frame)
        return;
    memcpy(frame, hdr, MUX_HDR);
    memcpy(frame + MUX_HDR, data, len);
    mux_write_all(serial, frame, MUX_HDR + len);
    free(frame);
}

static struct chan *chan_find(uint32_t id) {
    for (size_t i = 0; i < nchans; i++)
        if (chans[i].id == id)
            return &chans[i];
    return NULL;
}

static void chan_drop(size_t i) {
    close(chans[i].fd);
    mux_buffered -= chans[i].len;
    free(chans[i].out);
    chans[i] = chans[--nchans];
}

static void chan_open(int serial, uint32_t id) {
    int sv[2];
    if (chan_find(id) || socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) {
        mux_send(serial, id, 'C', NULL, 0);
        return;
    }
    pid_t pid = agent_fork(SLOT_HANDLER);
    if (pid == 0) {
        struct sigaction sa;
        memset(&sa, 0, sizeof(sa));
        sa.sa_handler = SIG_DFL;
        sigaction(SIGCHLD, &sa, NULL);
        sigaction(SIGTERM, &sa, NULL);
        sigaction(SIGINT, &sa, NULL);
        close(serial);
        close(reserve_sock[0]);
        close(sv[0]);
        for (size_t i = 0; i < nchans; i++)
            close(chans[i].fd);
        handle(sv[1]);
        _exit(0);
    }
    int served = pid > 0 || pass_to_reserve(sv[1]) == 0; /* no fork: the reserve serves kills and lists */
    close(sv[1]);
    if (!reserve_alive())
        ensure_reserve();
    if (!served) {
        close(sv[0]);
        mux_send(serial, id, 'C', NULL, 0);
        return;
    }
    if (nchans == chans_cap) {
        size_t ncap = chans_cap ? chans_cap * 2 : 64;
        struct chan *nc = realloc(chans, ncap * sizeof(*nc));
        if (!nc) {
            close(sv[0]);
            mux_send(serial, id, 'C', NULL, 0);
            return;
        }
        chans = nc;
        chans_cap = ncap;
    }
    set_nonblock(sv[0]);
    chans[nchans++] = (struct chan){id, sv[0], NULL, 0, 0, 0, 0, 0};
}

static void chan_flush(size_t i) {
    struct chan *c = &chans[i];
    while (c->len > 0) {
        ssize_t n = send(c->fd, c->out, c->len, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) { /* handler gone: drop what it will never read */
                mux_buffered -= c->len;
                c->len = 0;
            }
            return;
        }
        memmove(c->out, c->out + n, c->len - (size_t)n);
        c->len -= (size_t)n;
        mux_buffered -= (size_t)n;
    }
}

static void chan_queue(size_t i, const unsigned char *data, size_t len) {
    struct chan *c = &chans[i];
    if (c->cap - c->len < len) {
        size_t ncap = c->len + len + (64u << 10);
        unsigned char *nb = realloc(c->out, ncap);
        if (!nb)
            return;
        c->out = nb;
        c->cap = ncap;
    }
    memcpy(c->out + c->len, data, len);
    c->len += len;
    mux_buffered += len;
    chan_flush(i);
}

/* After a flush: pass on the host's half-close once its data is written; a channel both sides have
   ended is closed ('C' to the host).  Returns 1 if channel i was dropped. */
static int chan_settle(int serial, size_t i) {
    struct chan *c = &chans[i];
    if (c->host_eof && !c->shut && c->len == 0) {
        shutdown(c->fd, SHUT_WR);
        c->shut = 1;
    }
    if (c->shut && c->handler_eof) {
        mux_send(serial, c->id, 'C', NULL, 0);
        chan_drop(i);
        return 1;
    }
    return 0;
}

/* The host's first frame on every connection: channel 0, op 'R', 16-byte marker. */
static const unsigned char mux_reset[MUX_HDR + 16] = {0, 0, 0, 0, 'R', 0, 0, 0, 16, 'S', 'H', 'O', 'A', 'L', '-',
                                                      'M', 'U', 'X', '-', 'R', 'E', 'S', 'E', 'T', '1'};

static void serial_mux(const char *path) {
    int resync = 0;
    int serial = open(path, O_RDWR | O_CLOEXEC);
    if (serial < 0) {
        fprintf(stderr, "shoal-agent: open %s: %s\n", path, strerror(errno));
        _exit(1);
    }
    size_t icap_s = 1u << 20, ilen_s = 0;
    unsigned char *in = malloc(icap_s);
    unsigned char *rbuf = malloc(PIPE_CHUNK);
    struct pollfd *pfds = NULL;
    size_t pcap = 0;
    if (!in || !rbuf)
        _exit(1);
    for (;;) {
        if (pcap < nchans + 1) {
            pcap = (nchans + 1) * 2;
            pfds = realloc(pfds, pcap * sizeof(*pfds));
            if (!pfds)
                _exit(1);
        }
        pfds[0].fd = serial;
        pfds[0].events = mux_buffered < MUX_BUFFER_HIGH ? POLLIN : 0;
        pfds[0].revents = 0;
        for (size_t i = 0; i < nchans; i++) {
            pfds[i + 1].fd = chans[i].fd;
            pfds[i + 1].events = (short)((chans[i].handler_eof ? 0 : POLLIN) | (chans[i].len ? POLLOUT : 0));
            pfds[i + 1].revents = 0;
        }
        size_t polled = nchans;
        if (poll(pfds, polled + 1, -1) < 0)
            continue;
        if (pfds[0].revents & POLLIN) {
            if (icap_s - ilen_s < 65536) {
                unsigned char *nb = realloc(in, icap_s * 2);
                if (!nb)
                    _exit(1);
                in = nb;
                icap_s *= 2;
            }
            ssize_t n = read(serial, in + ilen_s, icap_s - ilen_s);
            if (n > 0) {
                ilen_s += (size_t)n;
                size_t pos = 0;
                if (resync) {
                    unsigned char *m = memmem(in, ilen_s, mux_reset, sizeof(mux_reset));
                    if (m == NULL) { /* keep a possible prefix of the marker, drop the rest */
                        size_t keep = ilen_s < sizeof(mux_reset) ? ilen_s : sizeof(mux_reset) - 1;
                        memmove(in, in + ilen_s - keep, keep);
                        ilen_s = keep;
                        continue;
                    }
                    pos = (size_t)(m - in);
                    resync = 0;
                }
                while (ilen_s - pos >= MUX_HDR) {
                    uint32_t ch = rd_u32(in + pos), len = rd_u32(in + pos + 5);
                    char op = (char)in[pos + 4];
                    if (ilen_s - pos < MUX_HDR + (size_t)len)
                        break;
                    const unsigned char *data = in + pos + MUX_HDR;
                    pos += MUX_HDR + (size_t)len;
                    if (op == 'O') {
                        chan_open(serial, ch);
                        continue;
                    }
                    if (op == 'R') { /* a new host connection: channels of earlier ones are stale */
                        while (nchans > 0)
                            chan_drop(nchans - 1);
                        continue;
                    }
                    struct chan *c = chan_find(ch);
                    if (!c)
                        continue;
                    size_t idx = (size_t)(c - chans);
                    if (op == 'D') {
                        chan_queue(idx, data, len);
                    } else if (op == 'E') {
                        c->host_eof = 1;
                        chan_settle(serial, idx);
                    } else if (op == 'C') {
                        chan_drop(idx);
                    }
                }
                memmove(in, in + pos, ilen_s - pos);
                ilen_s -= pos;
            } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
                pfds[0].revents |= POLLHUP;
            }
        }
        if ((pfds[0].revents & (POLLHUP | POLLERR)) && !(pfds[0].revents & POLLIN)) {
            /* No host (not yet, or any more). Channels stay until the host's 'R' says they are stale: a
               hangup can be reported late, after data of the next connection (separate virtqueues). A
               frame cut off by the hangup is skipped by resynchronising on the next 'R'. */
            if (ilen_s > 0)
                resync = 1;
            usleep(20000);
            continue;
        }
        /* Channels: the array may have changed above, so match poll results by fd. */
        for (size_t k = 0; k < polled; k++) {
            short rev = pfds[k + 1].revents;
            if (!rev)
                continue;
            size_t i;
            for (i = 0; i < nchans && chans[i].fd != pfds[k + 1].fd; i++) {
            }
            if (i == nchans)
                continue;
            if (rev & POLLOUT) {
                chan_flush(i);
                if (chan_settle(serial, i))
                    continue;
            }
            if (chans[i].handler_eof && (rev & (POLLHUP | POLLERR))) { /* the handler closed its end entirely */
                mux_send(serial, chans[i].id, 'C', NULL, 0);
                chan_drop(i);
            } else if (rev & (POLLIN | POLLHUP | POLLERR)) {
                ssize_t n = read(chans[i].fd, rbuf, PIPE_CHUNK);
                if (n > 0) {
                    mux_send(serial, chans[i].id, 'D', rbuf, (size_t)n);
                } else if (n == 0 && !chans[i].shut) { /* the handler's half-close: the host's side stays open */
                    chans[i].handler_eof = 1;
                    mux_send(serial, chans[i].id, 'E', NULL, 0);
                } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
                    mux_send(serial, chans[i].id, 'C', NULL, 0);
                    chan_drop(i);
                }
            }
        }
    }
}

/* A VM guest's loopback starts down (no init brings it up before us): the port relay connects to it. */
static void loopback_up(void) {
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0)
        return;
    struct ifreq ifr;
    memset(&ifr, 0, sizeof(ifr));
    strncpy(ifr.ifr_name, "lo", IFNAMSIZ - 1);
    if (ioctl(s, SIOCGIFFLAGS, &ifr) == 0 && !(ifr.ifr_flags & IFF_UP)) {
        ifr.ifr_flags |= IFF_UP;
        ioctl(s, SIOCSIFFLAGS, &ifr);
    }
    close(s);
}

static void main_sigchld(int s) {
    (void)s;
    int saved = errno;
    pid_t p;
    while ((p = waitpid(-1, NULL, WNOHANG)) > 0)
        slot_del(p);
    errno = saved;
}

static void main_sigterm(int s) {
    (void)s;
    _exit(0);
}

static int listen_on_path(const char *path) {
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof(addr));
    addr.sun_family = AF_UNIX;
    if (strlen(path) >= sizeof(addr.sun_path)) {
        fprintf(stderr, "shoal-agent: socket path too long: %s\n", path);
        return -1;
    }
    strcpy(addr.sun_path, path);
    unlink(path);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0 || bind(fd, (struct sockaddr *)&addr, sizeof(addr)) < 0 || listen(fd, 128) < 0) {
        fprintf(stderr, "shoal-agent: listen on %s: %s\n", path, strerror(errno));
        return -1;
    }
    if (fd < 3) { /* keep 0-2 free for the /dev/null fill below */
        int moved = fcntl(fd, F_DUPFD, 3);
        close(fd);
        fd = moved;
    }
    return fd;
}

/* gVisor: our socket lives in a host directory (the node's state) bind-mounted at the socket's directory.
   Once it is bound, cover that directory with an empty read-only tmpfs (the socket keeps working: it is
   bound, never looked up again) and give up CAP_SYS_ADMIN, which the node grants only for this: nothing in
   the sandbox can then write there (past disk_mb), plant links in the node's state, or uncover it. */
static int seal_listen_dir(const char *path) {
    char dir[PATH_MAX];
    snprintf(dir, sizeof(dir), "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash == NULL || slash == dir) {
        fprintf(stderr, "shoal-agent: %s: the socket must be in a directory of its own\n", path);
        return -1;
    }
    *slash = '\0';
    if (mount("shoal", dir, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0555") < 0) {
        fprintf(stderr, "shoal-agent: cannot seal %s: %s (the runtime must grant CAP_SYS_ADMIN)\n", dir,
                strerror(errno));
        return -1;
    }
    struct __user_cap_header_struct head = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct caps[2];
    memset(caps, 0, sizeof(caps));
    if (prctl(PR_CAPBSET_DROP, CAP_SYS_ADMIN, 0, 0, 0) < 0 || syscall(SYS_capget, &head, caps) < 0) {
        fprintf(stderr, "shoal-agent: cannot drop CAP_SYS_ADMIN: %s\n", strerror(errno));
        return -1;
    }
    for (int i = 0; i < 2; i++) {
        uint32_t keep = i == CAP_TO_INDEX(CAP_SYS_ADMIN) ? ~CAP_TO_MASK(CAP_SYS_ADMIN) : ~0u;
        caps[i].effective &= keep;
        caps[i].permitted &= keep;
        caps[i].inheritable &= keep;
    }
    if (syscall(SYS_capset, &head, caps) < 0) {
        fprintf(stderr, "shoal-agent: cannot drop CAP_SYS_ADMIN: %s\n", strerror(errno));
        return -1;
    }
    return 0;
}

int main(int argc, char **argv) {
    int lfd = 3, sealed = 0;
    const char *hold_ms = getenv("SHOAL_AGENT_PID_HOLD_MS");
    if (hold_ms && *hold_ms)
        pid_hold_ns = strtoll(hold_ms, NULL, 10) * 1000000LL;
    const char *serial = NULL;
    if (argc == 3 && strcmp(argv[1], "--fd") == 0) {
        lfd = atoi(argv[2]);
    } else if (argc == 3 && strcmp(argv[1], "--listen") == 0) {
        /* Runtimes that cannot hand us a socket (gVisor) share a directory with the node instead. */
        lfd = listen_on_path(argv[2]);
        if (lfd < 0 || seal_listen_dir(argv[2]) < 0)
            return 1;
        sealed = 1;
    } else if (argc == 3 && strcmp(argv[1], "--serial") == 0) {
        serial = argv[2];
    } else if (argc == 2 && strcmp(argv[1], "--version") == 0) {
        puts(AGENT_VERSION);
        return 0;
    } else if (argc != 1) {
        fprintf(stderr, "usage: shoal-agent [--fd N | --listen PATH | --serial /dev/vportNpM]\n");
        return 2;
    }
    /* Make sure fds 0-2 exist so pipes never land there. */
    for (int fd = 0; fd < 3; fd++) {
        if (fcntl(fd, F_GETFD) < 0 && open("/dev/null", O_RDWR) < 0)
            return 1;
    }
    /* Start from default signal dispositions and an empty mask, whatever our parent left us: ignored
       signals and the mask survive execve, and a command resets only the few signals we change (exec_child),
       so a signal ignored by whatever started us (a CI runner ignores signal 32) would reach every command.
       The raw system call, because libc refuses to touch the signals it reserves for threads (32, 33), and
       those are the ones a runner written against another libc may leave ignored. Once per agent. */
    for (int s = 1; s < NSIG; s++) {
        unsigned long cur[4] = {0}, dfl[4] = {0}; /* the kernel's struct sigaction: handler first */
        if (s != SIGKILL && s != SIGSTOP && syscall(SYS_rt_sigaction, s, NULL, cur, sizeof(uint64_t)) == 0 &&
            cur[0] == (unsigned long)SIG_IGN)
            syscall(SYS_rt_sigaction, s, dfl, NULL, sizeof(uint64_t));
    }
    sigset_t unblocked;
    sigemptyset(&unblocked);
    sigprocmask(SIG_SETMASK, &unblocked, NULL);
    int fl = serial ? 0 : fcntl(lfd, F_GETFL);
    if (serial) {
        /* handled below, once signals are set up */
    } else if (lfd < 3 || fl < 0 || fcntl(lfd, F_SETFD, FD_CLOEXEC) < 0) {
        fprintf(stderr, "shoal-agent: fd %d is not a usable listening socket\n", lfd);
        return 1;
    }
    if (!serial)
        fcntl(lfd, F_SETFL, fl & ~O_NONBLOCK);

    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = SIG_IGN;
    sigaction(SIGPIPE, &sa, NULL);
    sa.sa_handler = main_sigchld;
    sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    sigaction(SIGCHLD, &sa, NULL);
    if (getpid() == 1 && sealed) {
        /* As PID 1 the kernel shields us from signals we have no handler for, sent inside the sandbox;
           gVisor (the --listen case) does not, so ignore every catchable one there (KILL and STOP to PID 1
           are refused by the runsc seccomp profile). Commands get default dispositions back (exec_child). */
        sa.sa_handler = SIG_IGN;
        sa.sa_flags = 0;
        for (int s = 1; s < NSIG; s++) {
            if (s != SIGKILL && s != SIGSTOP && s != SIGCHLD)
                sigaction(s, &sa, NULL);
        }
        ignores_all = 1;
    } else if (getpid() != 1) {
        /* Outside a PID namespace (tests), exit on SIGTERM/SIGINT. */
        sa.sa_handler = main_sigterm;
        sa.sa_flags = 0;
        sigaction(SIGTERM, &sa, NULL);
        sigaction(SIGINT, &sa, NULL);
    }
    prctl(PR_SET_CHILD_SUBREAPER, 1);
    /* Not dumpable: a process in the sandbox, even root there, may not open /proc/1/mem, /proc/1/fd or
       /proc/1/environ, nor take our listening socket with pidfd_getfd (the ptrace access check then
       needs CAP_SYS_PTRACE, which sandboxes lack). Commands become dumpable again when they exec. */
    prctl(PR_SET_DUMPABLE, 0);
    agent_pid = getpid();
    slots_init();
    ensure_reserve();
    if (serial) {
        loopback_up();
        setup_commands_cgroup();
        serial_mux(serial);
    }

    for (;;) {
        int c = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        if (c < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
                usleep(10000);
                continue;
            }
            fprintf(stderr, "shoal-agent: accept: %s\n", strerror(errno));
            return 1;
        }
        pid_t pid = agent_fork(SLOT_HANDLER);
        if (pid == 0) {
            memset(&sa, 0, sizeof(sa));
            sa.sa_handler = SIG_DFL;
            sigaction(SIGCHLD, &sa, NULL);
            sigaction(SIGTERM, &sa, NULL);
            sigaction(SIGINT, &sa, NULL);
            close(lfd);
            close(reserve_sock[0]);
            handle(c);
            _exit(0);
        }
        if (pid < 0 && pass_to_reserve(c) == 0)
            pid = 0; /* the reserve serves it */
        if (!reserve_alive())
            ensure_reserve();
        if (pid < 0) {
            /* Typically the sandbox's pids limit: answer instead of dropping the connection, so the node
               reports a full sandbox rather than a lost one. */
            int err = errno;
            conn = c;
            send_err(err, "the agent could not fork a handler: %s (the sandbox is at its pids limit: "
                          "wait for processes to exit or kill them, or create it with a larger pids)",
                     strerror(err));
            conn = -1;
            usleep(1000);
        }
        close(c);
    }
}
