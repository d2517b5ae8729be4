/*
 * Background processes (included by agent.c: one translation unit, one agent).
 *
 * A background process outlives the connection that started it, and so the node's client: the handler
 * that starts it stays as its keeper.  The keeper holds the last `cap` bytes of its stdout and stderr (or
 * of its terminal) in two rings whose offsets count from the start, so a reader resumes where it left off;
 * it feeds the command's stdin, sends it signals, resizes its terminal, and serves any number of clients
 * that attach later: an 'A' request on a new connection names the keeper, and its handler passes that
 * connection to the keeper (SCM_RIGHTS over an abstract socket named after the keeper's pid, which only the
 * keeper can hold; the keeper takes connections from agent processes only, as SO_PEERCRED names them).  The keeper is a subreaper like every handler, so the command's
 * whole tree stays its for process lists and kills; it dies with the sandbox like everything in it.  After
 * the command exited it stays BG_LINGER_NS (BG_COLLECTED_NS once a client saw the exit) past the last
 * client, so a late `wait` still gets the exit status and the output.
 *
 * 'B': an exec request (parse_exec), then u16 rows, u16 cols (0: pipes; else a terminal of that size)
 *      -> 'P' u32 command pid, u32 keeper pid (the process's ID); then the connection closes.
 * 'A': u32 keeper, u8 mode, u64 stdout offset, u64 stderr offset, then client frames.
 *      mode 0 (read): the output from the offsets to now, then 'Y'.  1 (follow): the output until the
 *      command has exited and its output is drained, then 'Y'.  2 (control): the client frames, then 'Y'.
 *      Client frames (in the request and, when following, live): 'I' stdin bytes, 'C' close stdin (a
 *      terminal gets its EOF character), 'K' u32 signal (the command's group and every descendant),
 *      'W' u16 rows, u16 cols (the terminal's size: the command gets SIGWINCH).
 *      Keeper frames: 'P' u32 pid, u32 keeper, u8 pty (first); 'O'/'R' output; 'Q' u32 stream, u64 offset
 *      (what came before offset is gone from the ring: the stream continues there); 'Y' u64 stdout total,
 *      u64 stderr total, u8 running, i32 exit code, i32 signal (last); 'Z' error (last).
 * 'J': -> 'A' u32 count, per process: u32 keeper, u32 pid, u8 running, i32 exit code, i32 signal, u8 pty,
 *      u64 stdout total, u64 stderr total.
 */
#include <stddef.h>
#include <termios.h>

#define BG_CLIENTS 32
#define BG_RING_DEFAULT (1u << 20)
#define BG_STDIN_MAX (64u << 20)
#define BG_LINGER_NS (300LL * 1000000000LL)
#define BG_COLLECTED_NS (10LL * 1000000000LL)

struct bg_client {
    int fd, mode, done, dead;
    uint64_t off[2];
    unsigned char *out; /* one batch of frames being written */
    size_t olen, opos;
    unsigned char *in; /* received bytes not yet a whole frame */
    size_t ilen, icap;
};

static struct bg_client bg_cl[BG_CLIENTS];
static int bg_ncl = 0;
static struct tail bg_ring[2];
static struct slot *bg_me = NULL;
static int bg_term = -1, bg_in = -1, bg_close_pending = 0, bg_finished = 0, bg_collected = 0;
static unsigned char *bg_inbuf = NULL;
static size_t bg_in_len = 0, bg_in_off = 0;
#define BG_OUT_CAP (PIPE_CHUNK + 1024)

static uint64_t bg_total(int k) { return bg_ring[k].dropped + bg_ring[k].len; }

static int bg_addr(pid_t keeper, struct sockaddr_un *a) {
    memset(a, 0, sizeof(*a));
    a->sun_family = AF_UNIX;
    int n = snprintf(a->sun_path + 1, sizeof(a->sun_path) - 1, "shoal-bg-%d", (int)keeper);
    return (int)offsetof(struct sockaddr_un, sun_path) + 1 + n;
}

static pid_t peer_pid(int fd) {
    struct ucred cr;
    socklen_t len = sizeof(cr);
    return getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) < 0 ? -1 : cr.pid;
}

static void bgc_put(struct bg_client *cl, char type, const void *data, size_t len) {
    if (cl->olen + 5 + len > BG_OUT_CAP)
        return; /* cannot happen: data frames go into an empty buffer, the rest are small */
    put_u32(cl->out + cl->olen, (uint32_t)(len + 1));
    cl->out[cl->olen + 4] = (unsigned char)type;
    if (len)
        memcpy(cl->out + cl->olen + 5, data, len);
    cl->olen += 5 + len;
}

static void bgc_status(struct bg_client *cl) {
    unsigned char y[25];
    int code = 0, sig = 0;
    if (bg_finished) {
        code = WIFEXITED(cmd_status) ? WEXITSTATUS(cmd_status) : 128 + WTERMSIG(cmd_status);
        sig = WIFSIGNALED(cmd_status) ? WTERMSIG(cmd_status) : 0;
        bg_collected = 1;
    }
    put_u64(y, bg_total(0));
    put_u64(y + 8, bg_total(1));
    y[16] = (unsigned char)!bg_finished;
    put_u32(y + 17, (uint32_t)code);
    put_u32(y + 21, (uint32_t)sig);
    bgc_put(cl, 'Y', y, sizeof(y));
    cl->done = 1;
}

static void bgc_error(struct bg_client *cl, int err, const char *msg) {
    unsigned char z[256];
    size_t n = strlen(msg) < sizeof(z) - 4 ? strlen(msg) : sizeof(z) - 4;
    put_u32(z, (uint32_t)err);
    memcpy(z + 4, msg, n);
    bgc_put(cl, 'Z', z, 4 + n);
    cl->done = 1;
}

/* Queue what the client is owed next into its empty buffer; 0 if nothing is owed yet. */
static int bgc_fill(struct bg_client *cl) {
    if (cl->done)
        return 0;
    for (int k = 0; cl->mode != 2 && k < 2; k++) {
        struct tail *t = &bg_ring[k];
        if (cl->off[k] < t->dropped) { /* fell behind the ring: say where the stream continues */
            unsigned char q[12];
            put_u32(q, (uint32_t)k);
            put_u64(q + 4, t->dropped);
            bgc_put(cl, 'Q', q, sizeof(q));
            cl->off[k] = t->dropped;
        }
        if (cl->off[k] < bg_total(k)) {
            size_t pos = (t->start + (size_t)(cl->off[k] - t->dropped)) % t->cap;
            size_t n = (size_t)(bg_total(k) - cl->off[k]);
            if (n > t->cap - pos)
                n = t->cap - pos;
            if (n > PIPE_CHUNK)
                n = PIPE_CHUNK;
            bgc_put(cl, k ? 'R' : 'O', t->buf + pos, n);
            cl->off[k] += n;
            return 1;
        }
    }
    if (cl->mode != 1 || bg_finished) {
        bgc_status(cl);
        return 1;
    }
    return 0;
}

/* Write what is queued, queue more while the socket takes it; a client whose last frame went out is done. */
static void bgc_pump(struct bg_client *cl) {
    while (!cl->dead) {
        if (cl->opos < cl->olen) {
            ssize_t n = send(cl->fd, cl->out + cl->opos, cl->olen - cl->opos, MSG_DONTWAIT | MSG_NOSIGNAL);
            if (n > 0) {
                cl->opos += (size_t)n;
                continue;
            }
            if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
                return;
            cl->dead = 1;
            return;
        }
        cl->opos = cl->olen = 0;
        if (cl->done) {
            cl->dead = 1;
            return;
        }
        if (!bgc_fill(cl))
            return;
    }
}

static void bg_signal(int sig) {
    if (!cmd_reaped)
        kill_tree(sig);
    else
        kill_descendants(sig); /* what the command left running */
}

/* One client frame: stdin, close, signal, resize. */
static void bgc_frame(struct bg_client *cl, char type, const unsigned char *p, uint32_t n) {
    if (type == 'I') {
        if (bg_in < 0 || bg_close_pending || n == 0)
            return;
        if (bg_in_len - bg_in_off + n > BG_STDIN_MAX) {
            bgc_error(cl, ENOBUFS, "the process does not read its stdin: too much input is waiting for it");
            return;
        }
        if (bg_in_off > 0) {
            memmove(bg_inbuf, bg_inbuf + bg_in_off, bg_in_len - bg_in_off);
            bg_in_len -= bg_in_off;
            bg_in_off = 0;
        }
        unsigned char *nb = realloc(bg_inbuf, bg_in_len + n);
        if (!nb) {
            bgc_error(cl, ENOMEM, "stdin: out of memory");
            return;
        }
        bg_inbuf = nb;
        memcpy(bg_inbuf + bg_in_len, p, n);
        bg_in_len += n;
    } else if (type == 'C') {
        if (bg_term >= 0) { /* a terminal has no end: its EOF character ends a reader's line */
            struct termios tio;
            unsigned char eof = tcgetattr(bg_term, &tio) == 0 ? tio.c_cc[VEOF] : 4;
            bgc_frame(cl, 'I', &eof, 1);
        } else {
            bg_close_pending = 1;
        }
    } else if (type == 'K' && n >= 4) {
        uint32_t sig = rd_u32(p);
        if (sig > 0 && sig < (uint32_t)NSIG)
            bg_signal((int)sig);
    } else if (type == 'W' && n >= 4 && bg_term >= 0) {
        struct winsize ws = {(unsigned short)((p[0] << 8) | p[1]), (unsigned short)((p[2] << 8) | p[3]), 0, 0};
        ioctl(bg_term, TIOCSWINSZ, &ws);
    }
}

static void bgc_frames(struct bg_client *cl) {
    size_t pos = 0;
    while (!cl->done && cl->ilen - pos >= 5) {
        uint32_t l = rd_u32(cl->in + pos);
        if (l == 0 || l > MAX_FRAME) {
            bgc_error(cl, EMSGSIZE, "bad frame length");
            break;
        }
        if (cl->ilen - pos < 4 + (size_t)l)
            break;
        bgc_frame(cl, (char)cl->in[pos + 4], cl->in + pos + 5, l - 1);
        pos += 4 + (size_t)l;
    }
    memmove(cl->in, cl->in + pos, cl->ilen - pos);
    cl->ilen -= pos;
}

static void bgc_read(struct bg_client *cl) {
    if (cl->icap - cl->ilen < (64u << 10)) {
        size_t ncap = cl->icap + (64u << 10);
        if (cl->ilen >= 4 && rd_u32(cl->in) <= MAX_FRAME && 4 + (size_t)rd_u32(cl->in) > ncap)
            ncap = 4 + (size_t)rd_u32(cl->in);
        unsigned char *nb = realloc(cl->in, ncap);
        if (!nb) {
            cl->dead = 1;
            return;
        }
        cl->in = nb;
        cl->icap = ncap;
    }
    ssize_t n = recv(cl->fd, cl->in + cl->ilen, cl->icap - cl->ilen, MSG_DONTWAIT);
    if (n > 0) {
        cl->ilen += (size_t)n;
        bgc_frames(cl);
    } else if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        cl->dead = 1; /* gone: a follower that went away simply stops following */
    }
}

static int read_full(int fd, unsigned char *p, size_t n) {
    while (n) {
        ssize_t r = read(fd, p, n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

/* A handler passes a connection: u32 length + the fd, then the 'A' request and whatever followed it. */
static void bg_accept(int lfd) {
    int s = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
    if (s < 0)
        return;
    pid_t peer = peer_pid(s);
    if (peer <= 0 || (peer != agent_pid && slot_kind(peer) == 0)) { /* only the agent's own may attach */
        close(s);
        return;
    }
    struct timeval tv = {5, 0};
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    unsigned char lenb[4];
    char ctl[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {lenb, 4};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl, .msg_controllen = sizeof(ctl)};
    ssize_t r;
    while ((r = recvmsg(s, &m, MSG_CMSG_CLOEXEC | MSG_WAITALL)) < 0 && errno == EINTR) {
    }
    struct cmsghdr *cm = r == 4 ? CMSG_FIRSTHDR(&m) : NULL;
    int fd = -1;
    if (cm && cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS)
        memcpy(&fd, CMSG_DATA(cm), sizeof(int));
    uint32_t len = r == 4 ? rd_u32(lenb) : 0;
    unsigned char *blob = fd >= 0 && len >= 21 && len <= MAX_FRAME + (64u << 10) ? malloc(len) : NULL;
    if (!blob || read_full(s, blob, len) < 0) {
        free(blob);
        close(s);
        if (fd >= 0)
            close(fd);
        return;
    }
    close(s);
    if (bg_ncl == BG_CLIENTS) {
        conn = fd; /* blocking, small: the client learns why */
        send_err(EBUSY, "background process %d: %d clients are attached already", (int)getpid(), BG_CLIENTS);
        conn = -1;
        free(blob);
        close(fd);
        return;
    }
    struct bg_client *cl = &bg_cl[bg_ncl];
    memset(cl, 0, sizeof(*cl));
    cl->fd = fd;
    cl->out = malloc(BG_OUT_CAP);
    struct cur c = {blob + 4, len - 4, 0};
    cl->mode = get_u8(&c);
    cl->off[0] = get_u64(&c);
    cl->off[1] = get_u64(&c);
    cl->in = blob;
    cl->icap = len;
    cl->ilen = c.n;
    memmove(blob, c.p, c.n);
    if (!cl->out) {
        free(blob);
        close(fd);
        return;
    }
    bg_ncl++;
    unsigned char hdr[9];
    put_u32(hdr, (uint32_t)cmd_pid);
    put_u32(hdr + 4, (uint32_t)getpid());
    hdr[8] = (unsigned char)(bg_term >= 0);
    bgc_put(cl, 'P', hdr, sizeof(hdr));
    bgc_frames(cl);
}

static void bg_drop_dead(int64_t *idle_since) {
    for (int i = 0; i < bg_ncl;) {
        if (!bg_cl[i].dead) {
            i++;
            continue;
        }
        close(bg_cl[i].fd);
        free(bg_cl[i].out);
        free(bg_cl[i].in);
        bg_cl[i] = bg_cl[--bg_ncl];
        *idle_since = now_ns();
    }
}

static void do_background(const unsigned char *pl, uint32_t plen) {
    struct cur c = {pl, plen, 0};
    struct exec_req rq;
    if (parse_exec(&c, &rq, plen) < 0)
        return;
    uint32_t size = get_u32(&c);
    if (c.bad) {
        send_err(EINVAL, "background: malformed request");
        return;
    }
    unsigned rows = size >> 16, cols = size & 0xffff;
    int merge = (rq.flags & EXEC_MERGE_STDERR) != 0;
    struct sockaddr_un addr;
    socklen_t alen = (socklen_t)bg_addr(getpid(), &addr);
    int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&addr, alen) < 0 || listen(lfd, 16) < 0) {
        send_err(errno, "background %s: listen: %s", rq.argv[0], strerror(errno));
        return;
    }
    int slave = -1, outp[2] = {-1, -1}, errp[2] = {-1, -1}, inp[2] = {-1, -1};
    if (rows && cols) {
        unsigned int unlock = 0, ptn = 0;
        bg_term = open("/dev/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC);
        if (bg_term < 0 || ioctl(bg_term, TIOCSPTLCK, &unlock) < 0 || ioctl(bg_term, TIOCGPTN, &ptn) < 0) {
            send_err(errno, "pty: /dev/ptmx: %s", strerror(errno));
            return;
        }
        char name[32];
        snprintf(name, sizeof(name), "/dev/pts/%u", ptn);
        struct winsize ws = {(unsigned short)rows, (unsigned short)cols, 0, 0};
        slave = open(name, O_RDWR | O_NOCTTY | O_CLOEXEC);
        if (slave < 0 || ioctl(bg_term, TIOCSWINSZ, &ws) < 0) {
            send_err(errno, "pty: %s: %s", name, strerror(errno));
            return;
        }
        outp[0] = fcntl(bg_term, F_DUPFD_CLOEXEC, 3);
        bg_in = bg_term;
    } else if (pipe2(outp, O_CLOEXEC) < 0 || (!merge && pipe2(errp, O_CLOEXEC) < 0) ||
               ((rq.flags & EXEC_STDIN_PIPE) && pipe2(inp, O_CLOEXEC) < 0)) {
        send_err(errno, "background %s: pipe: %s", rq.argv[0], strerror(errno));
        return;
    }
    if (outp[0] < 0 || pipe2(sigchld_pipe, O_CLOEXEC | O_NONBLOCK) < 0) {
        send_err(errno, "background %s: pipe: %s", rq.argv[0], strerror(errno));
        return;
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_sigchld;
    sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    sigaction(SIGCHLD, &sa, NULL);
    slot_mark_self(SLOT_BG);
    for (int i = 0; slots && i < AGENT_SLOTS; i++)
        if (slots[i].pid == (int)getpid())
            bg_me = &slots[i];
    /* Started as an exec's command is (spawn_exec: a child sharing our memory, no fork of the keeper), which
       sends the start's 'P' (its pid, ours: the process's ID) itself before it execs: the command starts only
       once the node can know it started. */
    flush_out();
    /* following: the follower's buffer first, since its 'P' goes out with the start's (without it, no follower:
       the connection closes after the start's 'P' as an older agent's does, and the node attaches) */
    unsigned char *follow_out = (rq.flags & EXEC_BG_FOLLOW) ? malloc(BG_OUT_CAP) : NULL;
    int follow = follow_out != NULL;
    struct spawn sp = {rq.cwd, rq.uid, rq.gid, slave >= 0 ? slave : inp[0], slave >= 0 ? slave : outp[1],
                       slave >= 0 ? slave : (merge ? outp[1] : errp[1]), rq.argv, rq.envp, 0,
                       follow ? 1 + (bg_term >= 0) : 0, bg_me ? &bg_me->cmd : NULL, 0};
    if (bg_me)
        bg_me->pty = bg_term >= 0;
    pid_t pid = spawn_exec(&sp);
    if (pid < 0) {
        free(follow_out);
        send_err(errno, "background %s: fork: %s", rq.argv[0], strerror(errno));
        return;
    }
    cmd_pid = pid;
    if (sp.failed) /* the connection broke before the pid frame went out: the command did not start */
        conn_lost();
    if (slave >= 0)
        close(slave);
    if (outp[1] >= 0)
        close(outp[1]);
    if (errp[1] >= 0)
        close(errp[1]);
    if (inp[0] >= 0)
        close(inp[0]);
    if (inp[1] >= 0)
        bg_in = inp[1];
    int fds[2] = {outp[0], errp[0]};
    for (int k = 0; k < 2; k++)
        if (fds[k] >= 0)
            set_nonblock(fds[k]);
    if (bg_in >= 0)
        set_nonblock(bg_in);
    uint32_t cap = rq.cap ? rq.cap : BG_RING_DEFAULT;
    for (int k = 0; k < 2; k++)
        bg_ring[k] = (struct tail){NULL, cap < 4096 ? 4096 : cap, 0, 0, 0};
    if (follow) { /* the starter stays, a follower from offset 0 as if it had attached; its 'P' went out with
                     the start's (spawn_child) */
        struct bg_client *cl = &bg_cl[0];
        memset(cl, 0, sizeof(*cl));
        cl->fd = conn;
        cl->mode = 1;
        cl->out = follow_out;
        bg_ncl = 1;
        conn = -1;
    }
    if (conn >= 0)
        close(conn); /* from here on the process is on its own: clients attach ('A') */
    conn = -1;
    prctl(PR_SET_NAME, "shoal-bg");

    static unsigned char buf[PIPE_CHUNK];
    int64_t exit_at = 0, last_data = 0, idle_since = now_ns();
    reap_children();
    for (;;) {
        if (cmd_reaped && exit_at == 0) {
            exit_at = last_data = now_ns();
            if (bg_me)
                bg_me->status = cmd_status;
        }
        int64_t t = now_ns(), deadline = -1;
        if (cmd_reaped && !bg_finished) { /* drain what is still in the pipes, as exec does */
            int64_t until = last_data + DRAIN_IDLE_NS < exit_at + DRAIN_MAX_NS ? last_data + DRAIN_IDLE_NS
                                                                                 : exit_at + DRAIN_MAX_NS;
            if ((fds[0] < 0 && fds[1] < 0) || t >= until) {
                for (int k = 0; k < 2; k++)
                    if (fds[k] >= 0)
                        close(fds[k]);
                fds[0] = fds[1] = -1;
                bg_finished = 1;
            } else {
                deadline = until;
            }
        }
        if (bg_in >= 0 && bg_term < 0 && (bg_finished || (bg_close_pending && bg_in_len == bg_in_off))) {
            close(bg_in);
            bg_in = -1;
        }
        for (int i = 0; i < bg_ncl; i++)
            bgc_pump(&bg_cl[i]);
        bg_drop_dead(&idle_since);
        if (bg_finished && bg_ncl == 0) {
            int64_t from = exit_at > idle_since ? exit_at : idle_since;
            deadline = from + (bg_collected ? BG_COLLECTED_NS : BG_LINGER_NS);
            if (t >= deadline)
                break;
        }

        struct pollfd pfd[4 + BG_CLIENTS];
        int np = 0, i_cl = 0, i_out[2] = {-1, -1}, i_in = -1;
        pfd[np++] = (struct pollfd){lfd, POLLIN, 0};
        pfd[np++] = (struct pollfd){sigchld_pipe[0], POLLIN, 0};
        for (int k = 0; k < 2; k++)
            if (fds[k] >= 0) {
                i_out[k] = np;
                pfd[np++] = (struct pollfd){fds[k], POLLIN, 0};
            }
        if (bg_in >= 0 && bg_in_len > bg_in_off) {
            i_in = np;
            pfd[np++] = (struct pollfd){bg_in, POLLOUT, 0};
        }
        i_cl = np;
        for (int i = 0; i < bg_ncl; i++) {
            short ev = (short)(bg_cl[i].opos < bg_cl[i].olen ? POLLOUT : 0);
            if (bg_in_len - bg_in_off < STDIN_HIGH)
                ev |= POLLIN;
            pfd[np++] = (struct pollfd){bg_cl[i].fd, ev, 0};
        }
        int timeout = deadline < 0 ? -1 : (int)((deadline - t + 999999) / 1000000);
        int r = poll(pfd, (nfds_t)np, timeout);
        if (r <= 0)
            continue;
        if (pfd[1].revents) {
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
                tail_put(&bg_ring[k], buf, (size_t)n);
                if (bg_me)
                    bg_me->total[k] = bg_total(k);
                last_data = now_ns();
            } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) { /* a terminal says EIO at its end */
                close(fds[k]);
                fds[k] = -1;
            }
        }
        if (i_in >= 0 && pfd[i_in].revents) {
            ssize_t n = write(bg_in, bg_inbuf + bg_in_off, bg_in_len - bg_in_off);
            if (n > 0) {
                bg_in_off += (size_t)n;
                if (bg_in_off == bg_in_len)
                    bg_in_off = bg_in_len = 0;
            } else if (n < 0 && errno != EINTR && errno != EAGAIN) {
                bg_in_off = bg_in_len = 0; /* EPIPE: the command closed its stdin */
                if (bg_term < 0) {
                    close(bg_in);
                    bg_in = -1;
                }
            }
        }
        for (int i = 0; i < bg_ncl && i_cl + i < np; i++) {
            short rev = pfd[i_cl + i].revents;
            if (rev & POLLIN)
                bgc_read(&bg_cl[i]);
            else if (rev & (POLLHUP | POLLERR))
                bg_cl[i].dead = 1;
        }
        if (pfd[0].revents)
            bg_accept(lfd);
    }
    close(lfd);
    if (bg_term >= 0)
        close(bg_term);
    keep_leftovers();
}

/* 'A' on a new connection: hand it to the keeper of background process `keeper`. */
static void do_attach(const unsigned char *pl, uint32_t plen) {
    pid_t keeper = plen >= 21 ? (pid_t)rd_u32(pl) : 0;
    if (keeper <= 0) {
        send_err(EINVAL, "attach: malformed request");
        return;
    }
    struct sockaddr_un addr;
    socklen_t alen = (socklen_t)bg_addr(keeper, &addr);
    /* The slot says a keeper lives with that pid; only it can hold the name (bind is exclusive, and it
       bound it before it was marked).  SO_PEERCRED would say the same, but gVisor answers our own pid. */
    int s = slot_kind(keeper) == SLOT_BG ? socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0) : -1;
    if (s < 0 || connect(s, (struct sockaddr *)&addr, alen) < 0) {
        send_err(ESRCH, "no background process %d in this sandbox (it never was, or it exited and its output "
                        "was collected)", (int)keeper);
        if (s >= 0)
            close(s);
        return;
    }
    size_t extra = ilen - ipos; /* frames the client sent right after the request */
    unsigned char lenb[4];
    put_u32(lenb, (uint32_t)(plen + extra));
    char ctl[CMSG_SPACE(sizeof(int))];
    memset(ctl, 0, sizeof(ctl));
    struct iovec iov = {lenb, 4};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl, .msg_controllen = sizeof(ctl)};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &conn, sizeof(int));
    struct iovec parts[2] = {{(void *)pl, plen}, {ibuf + ipos, extra}};
    if (sendmsg(s, &m, MSG_NOSIGNAL) != 4) {
        send_err(errno, "attach %d: %s", (int)keeper, strerror(errno));
    } else {
        int saved = conn;
        conn = s; /* the rest goes to the keeper the same way replies go to a client */
        writev_all(parts, 2);
        conn = saved;
        /* Live until the keeper took it all and closed its end: it checks that we are an agent process by
           our slot, which main clears once we exit. */
        char tmp;
        while (read(s, &tmp, 1) < 0 && errno == EINTR) {
        }
    }
    close(s);
}

/* 'J' -> the background processes (their keepers' slots). */
static void do_list_bg(void) {
    size_t cap = 4 + 34 * 64, len = 4;
    unsigned char *out = malloc(cap);
    uint32_t count = 0;
    for (int i = 0; out && slots && i < AGENT_SLOTS; i++) {
        struct slot s = slots[i];
        if (s.pid == 0 || s.kind != SLOT_BG || s.cmd == 0)
            continue;
        if (len + 34 > cap) {
            unsigned char *more = realloc(out, cap * 2);
            if (!more)
                break;
            out = more;
            cap *= 2;
        }
        int running = s.status == -1;
        int code = running ? 0 : WIFEXITED(s.status) ? WEXITSTATUS(s.status) : 128 + WTERMSIG(s.status);
        int sig = !running && WIFSIGNALED(s.status) ? WTERMSIG(s.status) : 0;
        put_u32(out + len, (uint32_t)s.pid);
        put_u32(out + len + 4, (uint32_t)s.cmd);
        out[len + 8] = (unsigned char)running;
        put_u32(out + len + 9, (uint32_t)code);
        put_u32(out + len + 13, (uint32_t)sig);
        out[len + 17] = (unsigned char)s.pty;
        put_u64(out + len + 18, s.total[0]);
        put_u64(out + len + 26, s.total[1]);
        len += 34;
        count++;
    }
    if (!out) {
        send_err(ENOMEM, "background list: out of memory");
        return;
    }
    put_u32(out, count);
    send_ok(out, len);
    free(out);
}
