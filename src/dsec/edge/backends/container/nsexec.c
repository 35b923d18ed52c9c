/* dsec-nsexec: the zygote of the native container driver, and the code every sandbox
 * process runs before its command.
 *
 *   dsec-nsexec serve <socket fd> <seccomp BPF fd> <nested BPF fd> <init binary|"">
 *
 * The edge (native.py) starts one per backend and sends requests over a SOCK_SEQPACKET
 * socket (wire format below `serve`, Python side in protocol.py). Per request this
 * single-threaded process switches its pid namespace for children - setns into the
 * sandbox's (exec) or unshare a fresh one (create) - and fork()s; its address space is
 * tiny, so that is cheap, and it never blocks on a child. The child:
 *
 *   exec:   fds 0-2 stdio, 3 init pidfd, 4 seccomp BPF (memfd), 5 status pipe|/dev/null;
 *           setsid, join cgroups, setns(pidfd, mnt|net|uts|ipc|cgroup), user lookup in the
 *           sandbox's /etc/passwd, chdir, caps, setuid, no_new_privs, seccomp, execve.
 *   create: fds 3 status pipe, 4 seccomp BPF; PID 1 of the new pid namespace: join
 *           cgroups, unshare the other namespaces, overlay + /proc + /dev + /tmp + /sys +
 *           masks, pivot_root, hostname, lo up, caps, seccomp, execve the init.
 *   F_USERNS (spec.user_namespace): create also makes a user namespace mapping root to an
 *           unprivileged host range (net, uts, ipc owned by it; mnt, cgroup, pid by the
 *           host's), idmaps the lowerdirs with it and enters it last (after every
 *           mount); exec enters it after the other namespaces. See make_userns.
 *
 * Errors: exec writes "dsec: cannot run ..." to stderr (and the status pipe of a
 * background exec) and exits 127 (not found) or 126; create writes the reason to the
 * status pipe and exits 1. On success the close-on-exec status pipe reads EOF. The sandbox
 * layout tables (devices, masked and read-only paths, capabilities) are generated from
 * rootfs.py / linux.py into dsec_tables.h.
 *
 * Measured on the 2-core dev VM: a Python zygote forking itself per exec (~1.2 ms per
 * os.fork here) capped at ~600 execs/s with 64 in flight; this one reached ~2,000/s.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/mount.h>
#include <linux/seccomp.h>
#include <net/if.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <stdint.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include "dsec_tables.h"

#define FD_PIDFD 3
#define FD_BPF 4
#define FD_STATUS_EXEC 5
#define FD_STATUS_CREATE 3

#define NS_ENTER (CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWCGROUP)

static int status_fd = -1;   /* where failures are reported (create) */
static int userns_req = 0;   /* F_USERNS on the request being served (inherited by fork) */
static int exec_mode = 0;
static const char *exec_what = "";

static void die(int code, const char *fmt, ...) {
    char msg[1024];
    int saved = errno;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    char out[1400];
    int n;
    if (exec_mode)
        n = snprintf(out, sizeof out, "dsec: cannot run '%s': %s: %s\n", exec_what, msg,
                     strerror(saved));
    else
        n = snprintf(out, sizeof out, "%s: %s", msg, strerror(saved));
    if (n > (int)sizeof out - 1) n = sizeof out - 1;
    if (n > 0) {
        /* exec: stderr for the caller, and the status pipe (background execs; /dev/null
         * for foreground ones) so a detached exec that failed is reported too. */
        ssize_t w = write(exec_mode ? 2 : status_fd, out, (size_t)n);
        if (exec_mode) w = write(FD_STATUS_EXEC, out, (size_t)n);
        (void)w;
    }
    _exit(code);
}

static void write_file(const char *path, const char *data) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) die(126, "open %s", path);
    if (write(fd, data, strlen(data)) < 0) die(126, "write %s", path);
    close(fd);
}

static void join_cgroups(int n, char **paths) {
    for (int i = 0; i < n; i++) write_file(paths[i], "0");
}

/* Bounding set, ambient set, then capset: the container default set, nothing else. */
static void drop_caps(void) {
    for (int cap = 0; cap <= DSEC_CAP_LAST_CAP; cap++) {
        if (DSEC_KEEP_CAPS & (1ULL << cap)) continue;
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 && errno != EINVAL)
            die(126, "prctl(PR_CAPBSET_DROP, %d)", cap);
    }
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
    struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof data);
    for (int i = 0; i < 2; i++) {
        data[i].effective = data[i].permitted = (uint32_t)(DSEC_KEEP_CAPS >> (32 * i));
        data[i].inheritable = 0;
    }
    if (syscall(SYS_capset, &hdr, data) < 0) die(126, "capset");
}

/* no_new_privs, then the seccomp program the zygote compiled once with libseccomp. */
static void load_seccomp(void) {
    static struct sock_filter prog[BPF_MAXINSNS];
    ssize_t n = pread(FD_BPF, prog, sizeof prog, 0);
    if (n <= 0 || n % (ssize_t)sizeof(struct sock_filter)) {
        errno = EINVAL;
        die(126, "seccomp program of %zd bytes", n);
    }
    close(FD_BPF);
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) die(126, "prctl(PR_SET_NO_NEW_PRIVS)");
    struct sock_fprog fprog = {(unsigned short)(n / sizeof(struct sock_filter)), prog};
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &fprog, 0, 0) < 0)
        die(126, "prctl(PR_SET_SECCOMP)");
}

/* ---- exec ------------------------------------------------------------------------- */

/* uid/gid/home of `user` (name, uid, name:gid or uid:gid) from the sandbox's own
 * /etc/passwd; same rules as the former Python helper. The file is hostile: regular
 * files only, read at most 1 MiB, never block (a FIFO planted there would). */
static void lookup_user(const char *user, uid_t *uid, gid_t *gid, char *home, size_t homesz) {
    char name[256];
    const char *colon = strchr(user, ':');
    size_t nlen = colon ? (size_t)(colon - user) : strlen(user);
    if (nlen >= sizeof name) { errno = EINVAL; die(126, "user name too long"); }
    memcpy(name, user, nlen);
    name[nlen] = 0;
    int numeric = nlen > 0 && strspn(name, "0123456789") == nlen;
    int found = 0;
    snprintf(home, homesz, "/");
    if (numeric) *uid = *gid = (uid_t)strtoul(name, NULL, 10);
    static char buf[1 << 20];
    size_t len = 0;
    int fd = open("/etc/passwd", O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    struct stat st;
    if (fd >= 0 && fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
        ssize_t r;
        while (len < sizeof buf - 1 && (r = read(fd, buf + len, sizeof buf - 1 - len)) > 0)
            len += (size_t)r;
    }
    if (fd >= 0) close(fd);
    buf[len] = 0;
    for (char *line = buf; line && *line && !found;) {
        char *next = strchr(line, '\n');
        if (next) *next++ = 0;
        char *f[7] = {0};
        int nf = 0;
        for (char *p = line; nf < 7;) {
            f[nf++] = p;
            p = strchr(p, ':');
            if (!p) break;
            *p++ = 0;
        }
        if (nf >= 6) {
            if (numeric && strcmp(f[2], name) == 0) {
                *gid = (gid_t)strtoul(f[3], NULL, 10);
                snprintf(home, homesz, "%s", f[5]);
                found = 1;
            } else if (!numeric && strcmp(f[0], name) == 0) {
                *uid = (uid_t)strtoul(f[2], NULL, 10);
                *gid = (gid_t)strtoul(f[3], NULL, 10);
                snprintf(home, homesz, "%s", f[5]);
                found = 1;
            }
        }
        line = next;
    }
    if (!numeric && !found) { errno = ENOENT; die(126, "unknown user '%s' in /etc/passwd", name); }
    if (colon && colon[1] && strspn(colon + 1, "0123456789") == strlen(colon + 1))
        *gid = (gid_t)strtoul(colon + 1, NULL, 10);
}

/* execvpe with PATH taken from the *target* environment (glibc's execvpe would use ours). */
static void exec_path(char **argv, char **envp) {
    const char *file = argv[0];
    if (strchr(file, '/')) {
        execve(file, argv, envp);
        die(errno == ENOENT ? 127 : 126, "execve");
    }
    const char *path = "/bin:/usr/bin";
    for (char **e = envp; *e; e++)
        if (strncmp(*e, "PATH=", 5) == 0) path = *e + 5;
    int saw_eacces = 0, last = ENOENT;
    char full[4096];
    while (1) {
        const char *end = strchrnul(path, ':');
        size_t dl = (size_t)(end - path);
        if (dl + strlen(file) + 2 < sizeof full) {
            if (dl == 0) snprintf(full, sizeof full, "%s", file);
            else snprintf(full, sizeof full, "%.*s/%s", (int)dl, path, file);
            execve(full, argv, envp);
            if (errno == EACCES) saw_eacces = 1;
            else if (errno != ENOENT && errno != ENOTDIR) last = errno;
        }
        if (!*end) break;
        path = end + 1;
    }
    errno = saw_eacces ? EACCES : last;
    die(errno == ENOENT ? 127 : 126, "execvpe");
}

static int do_exec(int argc, char **argv) {
    /* argv: exec cwd user ncg cg... nenv env... -- target... */
    exec_mode = 1;
    int i = 2;
    if (argc < 6) { errno = EINVAL; die(126, "usage"); }
    const char *cwd = argv[i++];
    const char *user = argv[i++];
    int ncg = atoi(argv[i++]);
    char **cgs = &argv[i];
    i += ncg;
    if (i >= argc) { errno = EINVAL; die(126, "usage"); }
    int nenv = atoi(argv[i++]);
    char **env = &argv[i];
    i += nenv;
    if (i >= argc || strcmp(argv[i], "--") != 0 || i + 1 >= argc) { errno = EINVAL; die(126, "usage"); }
    char **target = &argv[i + 1];
    exec_what = target[0];
    fcntl(FD_STATUS_EXEC, F_SETFD, FD_CLOEXEC);
    syscall(SYS_close_range, FD_STATUS_EXEC + 1, ~0U, 0);
    if (setsid() < 0) die(126, "setsid");
    join_cgroups(ncg, cgs);
    /* pidfd setns (5.8+): all five namespaces at once; the mount namespace switch also
     * moves root and cwd to the sandbox's root. */
    if (setns(FD_PIDFD, NS_ENTER) < 0) die(126, "setns");
    /* user_namespace sandboxes: the user namespace last (its root may not join the
     * host-owned others), then become its root (host uid 0 is unmapped there). */
    if (userns_req) {
        if (setns(FD_PIDFD, CLONE_NEWUSER) < 0) die(126, "setns(user)");
        if (setgroups(0, NULL) < 0 || setresgid(0, 0, 0) < 0 || setresuid(0, 0, 0) < 0)
            die(126, "become root of the user namespace");
    }
    close(FD_PIDFD);
    uid_t uid = 0;
    gid_t gid = 0;
    char home[1024];
    int switch_user = user[0] != 0;
    if (switch_user) lookup_user(user, &uid, &gid, home, sizeof home);
    if (chdir(cwd[0] ? cwd : "/") < 0) die(126, "chdir %s", cwd);
    drop_caps();
    /* env: the request's, HOME replaced when switching user (as the Python helper did). */
    char **envp = calloc((size_t)nenv + 2, sizeof(char *));
    if (!envp) die(126, "calloc");
    int ne = 0;
    for (int k = 0; k < nenv; k++) {
        if (switch_user && strncmp(env[k], "HOME=", 5) == 0) continue;
        envp[ne++] = env[k];
    }
    static char homevar[1100];
    if (switch_user) {
        snprintf(homevar, sizeof homevar, "HOME=%s", home);
        envp[ne++] = homevar;
        if (setgroups(0, NULL) < 0) die(126, "setgroups");
        if (setgid(gid) < 0) die(126, "setgid(%u)", gid);
        if (setuid(uid) < 0) die(126, "setuid(%u)", uid);
    }
    envp[ne] = NULL;
    load_seccomp();
    exec_path(target, envp);
    return 126;
}

/* ---- create ----------------------------------------------------------------------- */

static char root_path[4096];

static const char *at_root(const char *p) {
    static char buf[8192];
    snprintf(buf, sizeof buf, "%s%s", root_path, p);
    return buf;
}

static void xmount(const char *src, const char *dst, const char *type, unsigned long fl,
                   const char *data) {
    if (mount(src, dst, type, fl, data) < 0)
        die(1, "mount(%s, %s, %s, 0x%lx, %s)", src ? src : "NULL", dst, type ? type : "NULL",
            fl, data ? data : "NULL");
}

static void xmkdir(const char *p, mode_t mode) {
    if (mkdir(p, mode) < 0 && errno != EEXIST) die(1, "mkdir %s", p);
}

static int exists(const char *p) {
    struct stat st;
    return stat(p, &st) == 0;
}

static int is_dir(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

/* A user namespace mapping root to host ids [base, base+size), as an fd. Only a process
 * of the parent namespace may write a multi-id map (opening the map file itself after the
 * target entered the namespace); we are PID 1 of a new pid namespace whose /proc is still
 * the host's, so a child's pid does not name its /proc entry here. Hence: a short-lived
 * child unshares the user namespace and reports its /proc name (readlink /proc/self); we
 * write its maps, open its ns/user and kill it - the namespace lives on through the fd.
 * Measured: see docs/container.md (create p50 with/without). */
#define NS_OWNED (CLONE_NEWNET | CLONE_NEWUTS | CLONE_NEWIPC)
static const char *const ns_owned_names[3] = {"net", "uts", "ipc"};

static int make_userns(const char *base, const char *size, int owned[3]) {
    int sync[2];
    if (pipe2(sync, O_CLOEXEC) < 0) die(1, "pipe2");
    pid_t h = fork();
    if (h < 0) die(1, "fork (user namespace)");
    if (h == 0) {
        char self[32] = "";
        /* net, uts and ipc with it, owned by it: the sandbox's root may then bind ports
         * < 1024, use raw sockets and set its hostname - in its own namespaces only. */
        if (unshare(CLONE_NEWUSER | NS_OWNED) == 0) {
            ssize_t n = readlink("/proc/self", self, sizeof self - 1);
            self[n > 0 ? n : 0] = 0;
        }
        if (write(sync[1], self, sizeof self) != sizeof self) _exit(1);
        for (;;) pause();
    }
    close(sync[1]);
    char self[32] = "", path[96], map[96];
    ssize_t r = read(sync[0], self, sizeof self);
    close(sync[0]);
    int fd = -1;
    if (r == sizeof self && self[0] && strspn(self, "0123456789") == strlen(self)) {
        int n = snprintf(map, sizeof map, "0 %s %s\n", base, size);
        snprintf(path, sizeof path, "/proc/%s/uid_map", self);
        int m = open(path, O_WRONLY | O_CLOEXEC);
        int ok = m >= 0 && write(m, map, (size_t)n) == n;
        if (m >= 0) close(m);
        snprintf(path, sizeof path, "/proc/%s/gid_map", self);
        m = ok ? open(path, O_WRONLY | O_CLOEXEC) : -1;
        ok = m >= 0 && write(m, map, (size_t)n) == n;
        if (m >= 0) close(m);
        for (int k = 0; ok && k < 3; k++) {
            snprintf(path, sizeof path, "/proc/%s/ns/%s", self, ns_owned_names[k]);
            ok = (owned[k] = open(path, O_RDONLY | O_CLOEXEC)) >= 0;
        }
        snprintf(path, sizeof path, "/proc/%s/ns/user", self);
        if (ok) fd = open(path, O_RDONLY | O_CLOEXEC);
    } else {
        errno = EPERM;
    }
    int saved = errno;
    kill(h, SIGKILL);
    waitpid(h, NULL, 0);
    errno = saved;
    if (fd < 0) die(1, "user namespace with map '0 %s %s' (%s)", base, size, path);
    return fd;
}

/* Cover every lowerdir of `overlay_opts` (in our private mount namespace) with an
 * idmapped clone of itself: files owned by host uid 0 there appear owned by the user
 * namespace's root, and the overlay - which reads lowers through these mounts - shows
 * them so; copy-ups keep that (mapped) owner. Paths hold no ':' or ',' (rootfs.py). */
static void idmap_lowers(const char *overlay_opts, int userns_fd) {
    char lows[4096];
    const char *l = strstr(overlay_opts, "lowerdir=");
    if (!l) { errno = EINVAL; die(1, "no lowerdir in overlay options"); }
    l += 9;
    size_t n = strcspn(l, ",");
    if (n >= sizeof lows) { errno = E2BIG; die(1, "lowerdir list"); }
    memcpy(lows, l, n);
    lows[n] = 0;
    for (char *dir = lows, *next; dir && *dir; dir = next) {
        next = strchr(dir, ':');
        if (next) *next++ = 0;
        int t = (int)syscall(SYS_open_tree, AT_FDCWD, dir, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
        if (t < 0) die(1, "open_tree %s", dir);
        struct mount_attr a;
        memset(&a, 0, sizeof a);
        a.attr_set = MOUNT_ATTR_IDMAP;
        a.userns_fd = (uint64_t)userns_fd;
        if (syscall(SYS_mount_setattr, t, "", AT_EMPTY_PATH, &a, sizeof a) < 0)
            die(1, "mount_setattr(MOUNT_ATTR_IDMAP) %s", dir);
        if (syscall(SYS_move_mount, t, "", AT_FDCWD, dir, MOVE_MOUNT_F_EMPTY_PATH) < 0)
            die(1, "move_mount %s", dir);
        close(t);
    }
}

static void build_root(const char *overlay_opts, const char *init_path, long long tmp_bytes,
                       int userns_fd) {
    char p[8192], q[8192], opts[256];
    xmount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL);
    if (userns_fd >= 0) idmap_lowers(overlay_opts, userns_fd);
    xmount("overlay", root_path, "overlay", MS_NODEV, overlay_opts);
    static const char *subdirs[] = {"/proc", "/dev", "/sys", "/tmp"};
    for (size_t k = 0; k < 4; k++) xmkdir(at_root(subdirs[k]), 0755);
    xmount("proc", at_root("/proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    char dev[4200];
    snprintf(dev, sizeof dev, "%s/dev", root_path);
    xmount("tmpfs", dev, "tmpfs", MS_NOSUID, "mode=755,size=64k,nr_inodes=64");
    for (size_t k = 0; k < sizeof DSEC_DEVICES / sizeof DSEC_DEVICES[0]; k++) {
        snprintf(p, sizeof p, "%s/%s", dev, DSEC_DEVICES[k].name);
        if (mknod(p, S_IFCHR | DSEC_DEVICES[k].mode,
                  makedev(DSEC_DEVICES[k].major, DSEC_DEVICES[k].minor)) < 0)
            die(1, "mknod %s", p);
        if (chmod(p, DSEC_DEVICES[k].mode) < 0) die(1, "chmod %s", p);
    }
    snprintf(p, sizeof p, "%s/pts", dev);
    xmkdir(p, 0755);
    xmount("devpts", p, "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620");
    snprintf(p, sizeof p, "%s/ptmx", dev);
    if (symlink("pts/ptmx", p) < 0) die(1, "symlink %s", p);
    snprintf(p, sizeof p, "%s/shm", dev);
    xmkdir(p, 01777);
    snprintf(opts, sizeof opts, "mode=1777,size=%lld", (long long)DSEC_SHM_BYTES);
    xmount("tmpfs", p, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, opts);
    static const char *links[][2] = {{"fd", "/proc/self/fd"}, {"stdin", "/proc/self/fd/0"},
                                     {"stdout", "/proc/self/fd/1"},
                                     {"stderr", "/proc/self/fd/2"}};
    for (size_t k = 0; k < 4; k++) {
        snprintf(p, sizeof p, "%s/%s", dev, links[k][0]);
        if (symlink(links[k][1], p) < 0) die(1, "symlink %s", p);
    }
    snprintf(p, sizeof p, "%s/.init", dev);
    int fd = open(p, O_CREAT | O_WRONLY | O_CLOEXEC, 0644);
    if (fd < 0) die(1, "create %s", p);
    close(fd);
    xmount(init_path, p, NULL, MS_BIND, NULL);
    xmount(NULL, p, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, NULL);
    snprintf(opts, sizeof opts, "mode=1777,size=%lld", tmp_bytes);
    xmount("tmpfs", at_root("/tmp"), "tmpfs", MS_NOSUID | MS_NODEV, opts);
    xmount("sysfs", at_root("/sys"), "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    snprintf(q, sizeof q, "%s/null", dev);
    for (size_t k = 0; k < sizeof DSEC_MASKED_FILES / sizeof DSEC_MASKED_FILES[0]; k++) {
        snprintf(p, sizeof p, "%s", at_root(DSEC_MASKED_FILES[k]));
        if (exists(p)) xmount(q, p, NULL, MS_BIND, NULL);
    }
    /* One empty read-only tmpfs, bind-mounted over every masked directory: each extra
     * superblock per sandbox adds to the kernel's per-memcg list_lru reparenting work when
     * any sandbox cgroup is removed (measured: that walk dominated destroy at 1,500
     * sandboxes), binds add none. */
    char first[8192] = "";
    for (size_t k = 0; k < sizeof DSEC_MASKED_DIRS / sizeof DSEC_MASKED_DIRS[0]; k++) {
        snprintf(p, sizeof p, "%s", at_root(DSEC_MASKED_DIRS[k]));
        if (!is_dir(p)) continue;
        if (!first[0]) {
            xmount("tmpfs", p, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                   "size=0,nr_inodes=1");
            snprintf(first, sizeof first, "%s", p);
        } else {
            xmount(first, p, NULL, MS_BIND, NULL);
            xmount(NULL, p, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
                   | MS_NOEXEC, NULL);
        }
    }
    for (size_t k = 0; k < sizeof DSEC_READONLY_PATHS / sizeof DSEC_READONLY_PATHS[0]; k++) {
        snprintf(p, sizeof p, "%s", at_root(DSEC_READONLY_PATHS[k]));
        if (exists(p)) {
            xmount(p, p, NULL, MS_BIND | MS_REC, NULL);
            xmount(NULL, p, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
                   | MS_NOEXEC, NULL);
        }
    }
    /* pivot_root(".", "."): the old root ends up stacked under the new one; detach it. */
    if (chdir(root_path) < 0) die(1, "chdir %s", root_path);
    if (syscall(SYS_pivot_root, ".", ".") < 0) die(1, "pivot_root");
    if (umount2(".", MNT_DETACH) < 0) die(1, "umount2(old root)");
    if (chdir("/") < 0) die(1, "chdir /");
}

static void loopback_up(void) {
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0) die(1, "socket");
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "lo");
    if (ioctl(s, SIOCGIFFLAGS, &ifr) < 0) die(1, "SIOCGIFFLAGS lo");
    ifr.ifr_flags |= IFF_UP;
    if (ioctl(s, SIOCSIFFLAGS, &ifr) < 0) die(1, "SIOCSIFFLAGS lo");
    close(s);
}

static int do_create(int argc, char **argv) {
    /* argv: create root overlay_opts hostname loopback tmp_bytes init ncg cg...
     *       [uid_base uid_count: with F_USERNS] */
    status_fd = FD_STATUS_CREATE;
    fcntl(status_fd, F_SETFD, FD_CLOEXEC);
    if (argc < 9) { errno = EINVAL; die(1, "usage"); }
    snprintf(root_path, sizeof root_path, "%s", argv[2]);
    const char *overlay_opts = argv[3];
    const char *hostname = argv[4];
    int loopback = atoi(argv[5]);
    long long tmp_bytes = atoll(argv[6]);
    const char *init_path = argv[7];
    int ncg = atoi(argv[8]);
    if (9 + ncg > argc) { errno = EINVAL; die(1, "usage"); }
    int userns_fd = -1;
    if (userns_req && 11 + ncg != argc) { errno = EINVAL; die(1, "usage (user namespace)"); }
    join_cgroups(ncg, &argv[9]);
    int unshared = NS_ENTER;
    if (userns_req) {
        int owned[3] = {-1, -1, -1};
        userns_fd = make_userns(argv[9 + ncg], argv[10 + ncg], owned);
        for (int k = 0; k < 3; k++) {  /* we stay host root until the end: we may join */
            if (setns(owned[k], 0) < 0) die(1, "setns(%s)", ns_owned_names[k]);
            close(owned[k]);
        }
        unshared &= ~NS_OWNED;
    }
    if (unshare(unshared) < 0) die(1, "unshare(0x%x)", unshared);
    umask(0);
    build_root(overlay_opts, init_path, tmp_bytes, userns_fd);
    umask(022);
    if (sethostname(hostname, strnlen(hostname, 64)) < 0) die(1, "sethostname");
    if (loopback) loopback_up();
    if (userns_fd >= 0) {
        /* Mounts, hostname and lo were set up as host root; from here on the sandbox is
         * its user namespace's root: host uid <base>, capabilities only in there. */
        if (setns(userns_fd, CLONE_NEWUSER) < 0) die(1, "setns(user)");
        close(userns_fd);
        if (setgroups(0, NULL) < 0 || setresgid(0, 0, 0) < 0 || setresuid(0, 0, 0) < 0)
            die(1, "become root of the user namespace");
    }
    int null = open("/dev/null", O_RDWR);
    if (null < 0) die(1, "open /dev/null");
    for (int k = 0; k < 3; k++)
        if (dup2(null, k) < 0) die(1, "dup2");
    if (null > 2) close(null);
    drop_caps();
    load_seccomp();
    /* Nothing but stdio and the (close-on-exec) status pipe may reach the init. */
    syscall(SYS_close_range, FD_BPF, ~0U, 0);
    char *init_argv[] = {"/dev/.init", "-P", NULL};
    char *init_env[] = {"PATH=/bin", NULL};
    execve("/dev/.init", init_argv, init_env);
    die(1, "execve /dev/.init");
    return 1;
}

/* ---- serve: the zygote ------------------------------------------------------------ */

/* Wire format (SOCK_SEQPACKET, one message each way per event; see protocol.py).
 * Request: struct req_hdr, then NUL-terminated strings = the exec/create argv above
 * (without the binary name; create without the init path, which we insert).
 * fds: exec -> [init pidfd, stdin, stdout, stderr]; create, kill -> none.
 * Reply: struct rep_hdr, then `len` bytes of message (Failed); Created carries a pidfd. */
enum { REQ_CREATE = 1, REQ_EXEC = 2, REQ_KILL = 3 };
enum { REP_CREATED = 1, REP_STARTED = 2, REP_EXITED = 3, REP_FAILED = 4 };
enum { F_BACKGROUND = 1, F_NESTED = 2, F_USERNS = 4 };
struct req_hdr { uint32_t type, flags; uint64_t id; };
struct rep_hdr { uint32_t type; int32_t pid; uint64_t id; int32_t ns_pid, status, err; uint32_t len; };

enum { J_FREE = 0, J_FG, J_BG, J_CREATE };
struct job { int kind; uint64_t id; pid_t pid; int status_fd, pidfd; };
static struct job *jobs;
static size_t njobs;
static int sock = -1, epfd = -1, sigfd = -1, own_pidns = -1, devnull = -1;
static int bpf_fds[2] = {-1, -1};
static const char *init_bin = "";

static void send_reply(uint32_t type, uint64_t id, pid_t pid, int ns_pid, int status, int err,
                       const char *msg, int fd) {
    struct rep_hdr h = {type, pid, id, ns_pid, status, err, msg ? (uint32_t)strlen(msg) : 0};
    struct iovec iov[2] = {{&h, sizeof h}, {(void *)(msg ? msg : ""), h.len}};
    union { char buf[CMSG_SPACE(sizeof(int))]; struct cmsghdr align; } u;
    struct msghdr m = {0};
    m.msg_iov = iov;
    m.msg_iovlen = 2;
    if (fd >= 0) {
        m.msg_control = u.buf;
        m.msg_controllen = sizeof u.buf;
        struct cmsghdr *c = CMSG_FIRSTHDR(&m);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &fd, sizeof fd);
    }
    while (sendmsg(sock, &m, MSG_NOSIGNAL) < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN) {  /* the edge is behind: wait for room */
            struct pollfd p = {sock, POLLOUT, 0};
            poll(&p, 1, 1000);
            continue;
        }
        _exit(0);  /* the edge went away; sandboxes keep running */
    }
}

static struct job *new_job(void) {
    for (size_t k = 0; k < njobs; k++)
        if (jobs[k].kind == J_FREE) return &jobs[k];
    size_t n = njobs ? njobs * 2 : 64;
    struct job *j = realloc(jobs, n * sizeof *j);
    if (!j) return NULL;
    memset(j + njobs, 0, (n - njobs) * sizeof *j);
    jobs = j;
    struct job *r = &jobs[njobs];
    njobs = n;
    return r;
}

static int ns_pid_of(pid_t pid) {
    char path[64], buf[4096];
    snprintf(path, sizeof path, "/proc/%d/status", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return pid;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return pid;
    buf[n] = 0;
    char *l = strstr(buf, "\nNSpid:");
    if (!l) return pid;
    char *end = strchr(l + 1, '\n');
    if (end) *end = 0;
    char *last = strrchr(l, '\t');
    return last ? atoi(last + 1) : pid;
}

/* fork with pid_ns_for_children switched (setns to `ns_fd`, or a new one if < 0) and
 * restored in the parent; the child gets `dups[i]` as fd i, everything else >= n closed,
 * and the signal mask we run with cleared. */
static pid_t fork_into(int ns_fd, const int *dups, int n) {
    if (ns_fd < 0 ? unshare(CLONE_NEWPID) : setns(ns_fd, CLONE_NEWPID)) return -1;
    pid_t pid = fork();
    if (pid == 0) {
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        for (int i = 0; i < n; i++)
            if (dup2(dups[i], i) < 0) _exit(126);
        syscall(SYS_close_range, n, ~0U, 0);
        return 0;
    }
    int saved = errno;
    if (setns(own_pidns, CLONE_NEWPID) < 0) _exit(3);  /* cannot happen; never half-switch */
    errno = saved;
    return pid;
}

static char *req_argv[1 << 16];

static void handle(char *data, size_t len, int *fds, int nfds) {
    struct req_hdr h;
    char err[256];
    if (len < sizeof h) goto bad;
    memcpy(&h, data, sizeof h);
    /* strings -> argv; slot 0 is the program name the child functions skip */
    int argc = 0;
    req_argv[argc++] = "dsec-nsexec";
    for (size_t off = sizeof h; off < len && argc < (int)(sizeof req_argv / sizeof *req_argv) - 2;) {
        char *z = memchr(data + off, 0, len - off);
        if (!z) goto bad;
        req_argv[argc++] = data + off;
        if (h.type == REQ_CREATE && argc == 7) req_argv[argc++] = (char *)init_bin;
        off = (size_t)(z - data) + 1;
    }
    req_argv[argc] = NULL;
    int bpf = bpf_fds[(h.flags & F_NESTED) ? 1 : 0];
    userns_req = (h.flags & F_USERNS) != 0;
    if (h.type == REQ_KILL) {
        for (size_t k = 0; k < njobs; k++)
            if (jobs[k].kind == J_FG && jobs[k].id == h.id) {
                kill(-jobs[k].pid, SIGKILL);
                kill(jobs[k].pid, SIGKILL);
            }
        goto out;
    }
    if (h.type == REQ_EXEC) {
        if (nfds != 4 || argc < 2 || strcmp(req_argv[1], "exec")) {
            snprintf(err, sizeof err, "exec needs 4 fds and an exec argv, got %d fds", nfds);
            send_reply(REP_FAILED, h.id, 0, 0, 0, EINVAL, err, -1);
            goto out;
        }
        int bg = h.flags & F_BACKGROUND;
        int sp[2] = {-1, -1};
        if (bg && pipe2(sp, O_CLOEXEC) < 0) goto sys;
        int dups[6] = {bg ? devnull : fds[1], bg ? devnull : fds[2], bg ? devnull : fds[3],
                       fds[0], bpf, bg ? sp[1] : devnull};
        struct job *j = new_job();
        if (!j) { errno = ENOMEM; goto sys_pipe; }
        pid_t pid = fork_into(fds[0], dups, 6);
        if (pid == 0) { do_exec(argc, req_argv); _exit(126); }
        if (pid < 0) goto sys_pipe;
        j->id = h.id;
        j->pid = pid;
        if (!bg) {
            j->kind = J_FG;
            send_reply(REP_STARTED, h.id, pid, pid, 0, 0, NULL, -1);
        } else {
            close(sp[1]);
            j->kind = J_BG;
            j->status_fd = sp[0];
            j->pidfd = -1;
            struct epoll_event ev = {EPOLLIN, {.ptr = j}};
            ev.data.u64 = (uint64_t)(j - jobs) + 2;
            epoll_ctl(epfd, EPOLL_CTL_ADD, sp[0], &ev);
        }
        goto out;
    sys_pipe:
        if (sp[0] >= 0) { close(sp[0]); close(sp[1]); }
        goto sys;
    }
    if (h.type == REQ_CREATE) {
        if (!init_bin[0]) {
            send_reply(REP_FAILED, h.id, 0, 0, 0, ENOENT,
                       "no init binary: install catatonit (/usr/bin/catatonit)", -1);
            goto out;
        }
        int sp[2];
        if (pipe2(sp, O_CLOEXEC) < 0) goto sys;
        struct job *j = new_job();
        int dups[5] = {devnull, devnull, devnull, sp[1], bpf};
        pid_t pid = j ? fork_into(-1, dups, 5) : -1;
        if (pid == 0) { do_create(argc, req_argv); _exit(1); }
        close(sp[1]);
        int pidfd = pid > 0 ? (int)syscall(SYS_pidfd_open, pid, 0) : -1;
        if (pid < 0 || pidfd < 0) {
            if (pid > 0) kill(pid, SIGKILL);
            close(sp[0]);
            goto sys;
        }
        fcntl(pidfd, F_SETFD, FD_CLOEXEC);
        *j = (struct job){J_CREATE, h.id, pid, sp[0], pidfd};
        struct epoll_event ev = {EPOLLIN, {.u64 = (uint64_t)(j - jobs) + 2}};
        epoll_ctl(epfd, EPOLL_CTL_ADD, sp[0], &ev);
        goto out;
    }
bad:
    send_reply(REP_FAILED, len >= sizeof h ? h.id : 0, 0, 0, 0, EINVAL, "undecodable request", -1);
    goto out;
sys:
    snprintf(err, sizeof err, "%s", strerror(errno));
    send_reply(REP_FAILED, h.id, 0, 0, 0, errno, err, -1);
out:
    for (int k = 0; k < nfds; k++) close(fds[k]);
}

static void on_status(struct job *j) {
    char msg[4096];
    ssize_t n = read(j->status_fd, msg, sizeof msg - 1);
    msg[n > 0 ? n : 0] = 0;
    epoll_ctl(epfd, EPOLL_CTL_DEL, j->status_fd, NULL);
    close(j->status_fd);
    if (j->kind == J_BG) {
        if (n > 0) send_reply(REP_FAILED, j->id, j->pid, 0, 0, 0, msg, -1);
        else send_reply(REP_STARTED, j->id, j->pid, ns_pid_of(j->pid), 0, 0, NULL, -1);
    } else {
        if (n > 0) send_reply(REP_FAILED, j->id, j->pid, 0, 0, 0, msg, -1);
        else send_reply(REP_CREATED, j->id, j->pid, j->pid, 0, 0, NULL, j->pidfd);
        close(j->pidfd);
    }
    j->kind = J_FREE;
}

static void reap(void) {
    struct signalfd_siginfo si;
    while (read(sigfd, &si, sizeof si) > 0) {}
    int st;
    pid_t pid;
    while ((pid = waitpid(-1, &st, WNOHANG)) > 0) {
        for (size_t k = 0; k < njobs; k++)
            if (jobs[k].kind == J_FG && jobs[k].pid == pid) {
                send_reply(REP_EXITED, jobs[k].id, pid, pid, st, 0, NULL, -1);
                jobs[k].kind = J_FREE;
                break;
            }
    }
}

static int high_fd(int fd) {
    int h = fcntl(fd, F_DUPFD_CLOEXEC, 10);
    if (h < 0) { perror("dsec-nsexec serve: fcntl"); exit(2); }
    close(fd);
    return h;
}

/* serve <socket fd> <bpf fd> <bpf fd, nested> <init binary or ""> */
static int do_serve(int argc, char **argv) {
    if (argc != 6) { fprintf(stderr, "usage: dsec-nsexec serve SOCK BPF BPF_NESTED INIT\n"); return 2; }
    /* Everything we hold lives at fd >= 10 and 3..9 are held on /dev/null, so the dup2s
     * of fork_into() (targets 0..5) never overwrite a source they still need. */
    sock = high_fd(atoi(argv[2]));
    bpf_fds[0] = high_fd(atoi(argv[3]));
    bpf_fds[1] = high_fd(atoi(argv[4]));
    init_bin = argv[5];
    for (;;) {
        int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
        if (fd < 0 || fd >= 10) { if (fd >= 0) close(fd); break; }
    }
    devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
    own_pidns = open("/proc/self/ns/pid", O_RDONLY | O_CLOEXEC);
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigprocmask(SIG_BLOCK, &chld, NULL);
    sigfd = signalfd(-1, &chld, SFD_NONBLOCK | SFD_CLOEXEC);
    epfd = epoll_create1(EPOLL_CLOEXEC);
    if (devnull < 0 || own_pidns < 0 || sigfd < 0 || epfd < 0) { perror("dsec-nsexec serve"); return 2; }
    struct epoll_event ev = {EPOLLIN, {.u64 = 0}};
    epoll_ctl(epfd, EPOLL_CTL_ADD, sock, &ev);
    ev.data.u64 = 1;
    epoll_ctl(epfd, EPOLL_CTL_ADD, sigfd, &ev);
    static char buf[4 << 20];
    union { char b[CMSG_SPACE(8 * sizeof(int))]; struct cmsghdr align; } u;
    for (;;) {
        struct epoll_event evs[64];
        int n = epoll_wait(epfd, evs, 64, -1);
        if (n < 0 && errno != EINTR) return 2;
        for (int e = 0; e < n; e++) {
            uint64_t tag = evs[e].data.u64;
            if (tag == 1) { reap(); continue; }
            if (tag >= 2) {
                struct job *j = &jobs[tag - 2];
                if (j->kind == J_BG || j->kind == J_CREATE) on_status(j);
                continue;
            }
            for (int burst = 0; burst < 256; burst++) {  /* drain queued requests */
                struct iovec iov = {buf, sizeof buf};
                struct msghdr m = {0};
                m.msg_iov = &iov;
                m.msg_iovlen = 1;
                m.msg_control = u.b;
                m.msg_controllen = sizeof u.b;
                ssize_t r = recvmsg(sock, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
                if (r < 0 && (errno == EAGAIN || errno == EINTR)) break;
                if (r <= 0) _exit(0);  /* the edge closed: sandboxes keep running */
                int fds[8], nfds = 0;
                for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c))
                    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
                        int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
                        for (int q = 0; q < k && nfds < 8; q++)
                            memcpy(&fds[nfds++], CMSG_DATA(c) + q * sizeof(int), sizeof(int));
                    }
                handle(buf, (size_t)r, fds, nfds);
            }
        }
    }
}

int main(int argc, char **argv) {
    /* Non-dumpable, inherited by every fork until its final execve: a sandbox process
     * cannot open /proc/<child>/root, cwd or fd/N while the child still holds host state
     * (it is in the sandbox's pid namespace from birth). */
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    if (argc >= 2 && strcmp(argv[1], "serve") == 0) return do_serve(argc, argv);
    fprintf(stderr, "usage: dsec-nsexec serve SOCK BPF BPF_NESTED INIT (started by the dsec edge)\n");
    return 2;
}
