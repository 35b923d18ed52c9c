/* dsec-nsexec: the zygote of the native container driver, and the code every sandbox
 * process runs before its command.
 *
 *   dsec-nsexec serve <socket fd> <seccomp BPF fd> <nested BPF fd> <init binary|"">
 *
 * The edge (native.py) starts one per backend and sends requests over a SOCK_SEQPACKET
 * socket (wire format below `serve`, Python side in protocol.py). Per request this
 * single-threaded process fork()s an *intermediate* child - its address space is tiny, so
 * that is cheap - and never blocks on it. Everything else runs in the children, in C:
 *
 *   exec    intermediate (host pid namespace, so invisible from inside the sandbox):
 *           fds 0-2 stdio, 3 init pidfd, 4 seccomp BPF (memfd), 5 status pipe|/dev/null,
 *           6 report socket; joins the cgroups (the exec's own freezer/v2 cgroup first),
 *           setns(pidfd, mnt|net|uts|ipc|cgroup|pid) [+ user], then clone(CLONE_PARENT)s
 *           the command's process, which is born fully inside: the sandbox's namespaces,
 *           root and cgroups. It reports that child's pid to us and exits. The child:
 *           setsid, user lookup in the sandbox's /etc/passwd, chdir, caps, setuid,
 *           no_new_privs, seccomp, execve.
 *   create  intermediate: fds 3 status pipe, 4 seccomp BPF, 6 report socket; joins the
 *           cgroups, unshares mnt/net/uts/ipc/cgroup (user namespace: see make_userns),
 *           builds the root (overlay from /proc/self/fd paths - no host path reaches the
 *           sandbox's mountinfo - /dev, /tmp, /sys), then unshares the pid namespace and
 *           clone(CLONE_PARENT)s its PID 1, which mounts /proc, masks, pivot_root, caps,
 *           seccomp and execs the init.
 *
 * Why the intermediate (issue 11.3; runc's nsexec does the same): a process is visible in
 * the sandbox's /proc from the moment it exists in its pid namespace, and /proc/<pid>/
 * {mountinfo,net/...} show *that process's* namespaces. A child forked straight into the pid
 * namespace was readable there while it still had the host's mount and network
 * namespaces. Entering the pid namespace last, with one more fork, closes that window.
 * CLONE_PARENT makes us the parent of the final process, so we reap it and hand its exit
 * status to the edge; the intermediate reports its pid over the report socket (a pidfd
 * is opened for it then: an unreaped child cannot be confused with another process).
 * The final process is cloned CLONE_VM: it shares the intermediate's memory until its
 * execve, so the extra process costs no page-table copy (measured: exec and create CPU per
 * call equal to the single-fork design's). An exec's final process runs nothing before the
 * intermediate reported it and sent a go byte, and the intermediate never waits for it
 * (run_exec_final: nothing in the sandbox can hold the intermediate); create's PID 1,
 * alone in its new pid namespace, is a CLONE_VFORK clone (run_init).
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
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/mount.h>
#include <linux/landlock.h>
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
#include <sys/file.h>
#include <sys/vfs.h>
#include <sys/ioctl.h>
#include <stdint.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
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
#define FD_REPORT 6   /* intermediate -> zygote: "my child is pid N" (SOCK_SEQPACKET) */
#define FD_NETNS 5    /* create with F_NETNS: the slot's network namespace (the edge's) */

#define NS_ENTER (CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWCGROUP)

static int status_fd = -1;   /* where failures are reported (create) */
static int userns_req = 0;   /* F_USERNS on the request being served (inherited by fork) */
static int netns_req = 0;    /* F_NETNS: join the passed netns instead of a new one */
static int sysfs_req = 0;    /* F_SYSFS: bind the node's shared sysfs (last argv) at /sys */
static int ipccaps_req = 0;  /* F_IPCCAPS: see ipc_caps */
static int lazypts_req = 0;  /* F_LAZYPTS: no devpts at create; the first pty exec mounts it */
static int scratch_req = 0;  /* F_SCRATCH: the sandbox's dir of the node's shared scratch
                              * tmpfs (last argv) holds its /dev and /tmp */
static const char *ipc_caps = NULL;  /* F_IPCCAPS: "name=value;..." (last argv), written
                                      * to the sandbox's ipc sysctls (write_ipc_caps) */
static int exec_mode = 0;
static int pty_req = 0;      /* F_PTY on the request being served */
static unsigned short pty_cols = 80, pty_rows = 24;
static const char *exec_what = "";
static const char *init_bin = "";
/* The job slot and generation the intermediate reports for (set before its fork). */
static uint32_t my_slot, my_gen;

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


/* ---- the intermediate's last step --------------------------------------------------- */

struct report { uint32_t slot, gen; int32_t pid, pad; };

static void send_report(pid_t pid) {
    struct report r = {my_slot, my_gen, pid, 0};
    while (send(FD_REPORT, &r, sizeof r, MSG_NOSIGNAL) < 0 && errno == EINTR) {}
}

/* The final process's side of the start handshake: it runs nothing of its own before the
 * intermediate has reported its pid (and, at the task limit, moved it into the sandbox's
 * pids cgroup). One byte = go; EOF = the intermediate died first - then it must not run:
 * nobody knows its pid, and at the task limit it would run outside the pids cgroup
 * (outside every sandbox cgroup on v2). Also drops the host cgroup fds it inherited. */
static int go_fds[2] = {-1, -1};
static int held_fds[2] = {-1, -1};  /* pids_fd, home_fd: cgroup.procs opened as host root */
/* Set by the intermediate once it reported: the final process of the fast path shares our
 * memory, and usually runs after we exited (we keep the CPU after clone) - then it finds
 * this set and skips the blocking read (no extra wakeup on the exec's path). */
static int go_now;

static void await_go(void) {
    close(FD_REPORT);
    for (int k = 0; k < 2; k++)
        if (held_fds[k] >= 0) close(held_fds[k]);
    close(go_fds[1]);
    ssize_t n = 1;
    if (!__atomic_load_n(&go_now, __ATOMIC_ACQUIRE)) {
        char c = 0;
        while ((n = read(go_fds[0], &c, 1)) < 0 && errno == EINTR) {}
    }
    close(go_fds[0]);
    if (n != 1) { errno = ECHILD; die(126, "the exec helper died before the command started"); }
}

/* fork whose child gets our parent (the zygote) as its parent. A raw clone like fork():
 * we are single-threaded and the child calls nothing that trusts glibc's cached tid. */
static pid_t clone_parent(void) {
    return (pid_t)syscall(SYS_clone, (unsigned long)CLONE_PARENT, 0, NULL, NULL, 0);
}

/* Intermediate at the task limit: fork the final process outside the pids cgroup, move it
 * in, report, let it go, exit. Returns only in the final process.
 *
 * A sandbox at its task limit refuses the final process's clone (the intermediate is
 * already counted in its pids cgroup), yet an exec must still get in - to look, or to kill
 * the fork bomb. So, with `pids_fd` (the cgroup.procs the limit applies to) and `home_fd`
 * (ours before joining) opened before the setns (cgroupfs checks the opener's credentials
 * and cgroup namespace): step back out of the limited cgroup, fork, move the child in -
 * migration is not limited - and only then let it run. While it waits it is inside in
 * every respect but its pids cgroup, which /proc/<pid>/cgroup inside shows as "/../.."
 * (the sandbox's cgroups sit two levels below ours): no host name. */
static void spawn_final(int fail_code, int pids_fd, int home_fd) {
    if (write(home_fd, "0", 1) < 0) die(fail_code, "leave the task-limited cgroup");
    pid_t pid = clone_parent();
    if (pid < 0) die(fail_code, "clone into the sandbox's pid namespace");
    if (pid == 0) return;  /* the final process: waits for the go byte first thing */
    char num[24];
    int n = snprintf(num, sizeof num, "%d", (int)pid);
    if (write(pids_fd, num, (size_t)n) < 0) {
        int saved = errno;
        kill(pid, SIGKILL);  /* our own, still waiting: never runs outside */
        errno = saved;
        die(fail_code, "move the command into the sandbox's pids cgroup");
    }
    send_report(pid);
    if (write(go_fds[1], "g", 1) < 0) {}  /* EPIPE: it died meanwhile (the zygote reaps) */
    _exit(0);
}

/* The exec's final process. It shares our memory (CLONE_VM: no page-table copy - a
 * fork's main cost on this PVM VM) but not our wait: we report its pid, hand it the go
 * byte and exit while it sets up and execs. It used to be CLONE_VFORK (we waited until its
 * execve), but it is visible inside from birth, and a sandbox process that SIGSTOPped it
 * there held us - a pending intermediate - for good (rt-kernel review): a background
 * exec never answered, and the zygote, which reaps no unknown child while an
 * intermediate is pending, stopped reaping other sandboxes' inits. Now nothing inside can
 * hold us. Until the go byte the final process runs nothing, so we are done with the
 * shared memory before it starts (we touch only our own stack and the report socket).
 * At the task limit the clone fails like any fork: then spawn_final's slow path. */
static char final_stack[256 << 10] __attribute__((aligned(64)));

static void run_exec_final(int pids_fd, int home_fd, int (*fn)(void *), void *arg) {
    if (pipe2(go_fds, O_CLOEXEC) < 0) die(126, "pipe2");
    held_fds[0] = pids_fd;
    held_fds[1] = home_fd;
    signal(SIGPIPE, SIG_IGN);  /* a go byte to a final process that died: no matter */
    pid_t pid = clone(fn, final_stack + sizeof final_stack, CLONE_VM | CLONE_PARENT, arg);
    if (pid < 0 && errno == EAGAIN && pids_fd >= 0 && home_fd >= 0) {
        spawn_final(126, pids_fd, home_fd);  /* returns in the final process */
        _exit(fn(arg));
    }
    if (pid < 0) die(126, "clone into the sandbox's pid namespace");
    send_report(pid);
    __atomic_store_n(&go_now, 1, __ATOMIC_RELEASE);
    if (write(go_fds[1], "g", 1) < 0) {}
    _exit(0);
}

/* The create's PID 1: shares our memory until its execve and we wait for that
 * (CLONE_VM | CLONE_VFORK, as posix_spawn does); it has its own fd table and credentials.
 * Nothing can see or signal it meanwhile - it is alone in a new pid namespace. */
static void run_init(int (*fn)(void *), void *arg) {
    pid_t pid = clone(fn, final_stack + sizeof final_stack,
                      CLONE_VM | CLONE_VFORK | CLONE_PARENT, arg);
    if (pid < 0) die(1, "clone into the sandbox's pid namespace");
    send_report(pid);
    _exit(0);
}

struct final_args { const char *cwd, *user, *hide; int nenv; char **env, **target; };

/* ---- hide: Landlock ------------------------------------------------------------------
 * The command's tree may use every top-level entry of the sandbox root except the ':'-
 * separated names in `hide` (Landlock has allow rules only: one rule per other entry,
 * with every right). Landlock holds whatever the uid: root in the sandbox cannot read,
 * write, link, rename or truncate anything under a hidden entry, through any path
 * (/proc/<pid>/root, symlinks, fds re-opened via /proc), nor ptrace or (ABI 6) signal a
 * process outside its domain or reach an abstract unix socket made outside it; mounts
 * are refused to it. The cost: nothing may be created or listed directly in "/" (no
 * rule can allow "/" without allowing all beneath it). Fail closed: no Landlock, die. */
#ifndef LANDLOCK_ACCESS_FS_TRUNCATE
#define LANDLOCK_ACCESS_FS_TRUNCATE (1ULL << 14)
#endif
#ifndef LANDLOCK_ACCESS_FS_IOCTL_DEV
#define LANDLOCK_ACCESS_FS_IOCTL_DEV (1ULL << 15)
#endif
struct ll_ruleset_attr { uint64_t handled_access_fs, handled_access_net, scoped; };
struct ll_path_beneath { uint64_t allowed_access; int32_t parent_fd; } __attribute__((packed));
#define LL_FILE_RIGHTS (LANDLOCK_ACCESS_FS_EXECUTE | LANDLOCK_ACCESS_FS_WRITE_FILE | \
                        LANDLOCK_ACCESS_FS_READ_FILE | LANDLOCK_ACCESS_FS_TRUNCATE | \
                        LANDLOCK_ACCESS_FS_IOCTL_DEV)

static int hidden(const char *name, const char *hide) {
    size_t n = strlen(name);
    for (const char *p = hide; *p;) {
        const char *e = strchr(p, ':');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        if (len == n && strncmp(p, name, n) == 0) return 1;
        if (!e) break;
        p = e + 1;
    }
    return 0;
}

static void hide_paths(const char *hide) {
    long abi = syscall(SYS_landlock_create_ruleset, NULL, 0, LANDLOCK_CREATE_RULESET_VERSION);
    if (abi < 1) die(126, "hide needs Landlock, which this kernel does not offer");
    uint64_t fs = (1ULL << 14) - 1;                 /* ABI 1-2: EXECUTE .. REFER */
    if (abi < 2) fs &= ~LANDLOCK_ACCESS_FS_REFER;
    if (abi >= 3) fs |= LANDLOCK_ACCESS_FS_TRUNCATE;
    if (abi >= 5) fs |= LANDLOCK_ACCESS_FS_IOCTL_DEV;
    struct ll_ruleset_attr attr = {fs, 0, abi >= 6 ? 3 : 0};   /* scoped: abstract unix, signal */
    size_t attr_size = abi >= 6 ? sizeof attr : 2 * sizeof(uint64_t);
    if (abi < 4) attr_size = sizeof(uint64_t);
    int rs = (int)syscall(SYS_landlock_create_ruleset, &attr, attr_size, 0);
    if (rs < 0) die(126, "landlock_create_ruleset");
    DIR *d = opendir("/");
    if (!d) die(126, "opendir /");
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..") || hidden(de->d_name, hide))
            continue;
        int fd = openat(dirfd(d), de->d_name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0) continue;
        struct stat st;
        if (fstat(fd, &st) < 0 || S_ISLNK(st.st_mode)) { close(fd); continue; }  /* its target is another entry */
        struct ll_path_beneath pb = {S_ISDIR(st.st_mode) ? fs : (fs & LL_FILE_RIGHTS), fd};
        if (syscall(SYS_landlock_add_rule, rs, LANDLOCK_RULE_PATH_BENEATH, &pb, 0) < 0)
            die(126, "landlock_add_rule /%s", de->d_name);
        close(fd);
    }
    closedir(d);
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) die(126, "prctl(PR_SET_NO_NEW_PRIVS)");
    if (syscall(SYS_landlock_restrict_self, rs, 0) < 0) die(126, "landlock_restrict_self");
    close(rs);
}
static int exec_final(void *arg);

static int do_exec(int argc, char **argv) {
    /* argv: exec cwd user ncg cg... pids_index home_procs hide nenv env... -- target... */
    exec_mode = 1;
    int i = 2;
    if (argc < 9) { errno = EINVAL; die(126, "usage"); }
    const char *cwd = argv[i++];
    const char *user = argv[i++];
    int ncg = atoi(argv[i++]);
    if (ncg < 0 || i + ncg + 2 >= argc) { errno = EINVAL; die(126, "usage"); }
    char **cgs = &argv[i];
    i += ncg;
    int pids_index = atoi(argv[i++]);
    const char *home_procs = argv[i++];
    const char *hide = argv[i++];
    int nenv = atoi(argv[i++]);
    char **env = &argv[i];
    i += nenv;
    if (i >= argc || strcmp(argv[i], "--") != 0 || i + 1 >= argc) { errno = EINVAL; die(126, "usage"); }
    char **target = &argv[i + 1];
    exec_what = target[0];
    fcntl(FD_STATUS_EXEC, F_SETFD, FD_CLOEXEC);
    syscall(SYS_close_range, FD_REPORT + 1, ~0U, 0);
    /* Intermediate, in the host's pid namespace (nothing inside can see it): the cgroups
     * first (the edge lists the exec's freezer/v2 cgroup first, so a kill that freezes it
     * finds us), then every namespace at once with the pidfd (5.8+) - the mount namespace
     * switch also moves root and cwd to the sandbox's root - and the pid namespace for
     * children, so the fork below is born fully inside. */
    int pids_fd = pids_index >= 0 && pids_index < ncg
        ? open(cgs[pids_index], O_WRONLY | O_CLOEXEC) : -1;
    int home_fd = home_procs[0] ? open(home_procs, O_WRONLY | O_CLOEXEC) : -1;
    join_cgroups(ncg, cgs);
    if (setns(FD_PIDFD, NS_ENTER | CLONE_NEWPID) < 0) die(126, "setns");
    /* user_namespace sandboxes: the user namespace last (its root may not join the
     * host-owned others), then become its root (host uid 0 is unmapped there). */
    if (userns_req) {
        if (setns(FD_PIDFD, CLONE_NEWUSER) < 0) die(126, "setns(user)");
        if (setgroups(0, NULL) < 0 || setresgid(0, 0, 0) < 0 || setresuid(0, 0, 0) < 0)
            die(126, "become root of the user namespace");
    }
    close(FD_PIDFD);
    struct final_args a = {cwd, user, hide, nenv, env, target};
    run_exec_final(pids_fd, home_fd, exec_final, &a);
    return 126;
}

#ifndef TIOCGPTPEER
#define TIOCGPTPEER _IO('T', 0x41)
#endif
/* F_PTY: a terminal inside the sandbox (its own devpts instance, so nothing of the host's
 * ptys is reachable or counted), made the command's controlling terminal and stdio. The
 * master goes to the edge over fd 0, which for a pty exec is a socket the edge made for
 * this (SCM_RIGHTS); the edge reads output and writes input there, and resizes it
 * (TIOCSWINSZ: the kernel signals SIGWINCH to the foreground group). The slave is opened
 * from the master (TIOCGPTPEER: no path lookup in /dev/pts, which the sandbox owns), and
 * the master must be the real multiplexer (char 5:2), else nothing is sent. */
#ifndef DEVPTS_SUPER_MAGIC
#define DEVPTS_SUPER_MAGIC 0x1cd1
#endif
#ifndef TMPFS_MAGIC
#define TMPFS_MAGIC 0x01021994
#endif
/* F_LAZYPTS sandboxes (ContainerBackend lazy_devpts) get no devpts instance at create -
 * one superblock less per sandbox, and every superblock costs every memory cgroup a
 * shrinker slot (docs/container.md, Density) - so the first pty exec mounts the
 * sandbox's own instance here, in its mount namespace, still with every capability (not
 * for user-namespace sandboxes: those get theirs at create). /dev/pts is the sandbox's
 * to change: it is opened without following a symlink and must be a directory of its
 * scratch tmpfs (else refused), the mount goes onto that opened directory (move_mount
 * by fd, no second path walk), and a lock on it serialises concurrent first pty execs
 * (the loser finds the devpts and uses it). */
static void ensure_devpts(void) {
    int d = open("/dev/pts", O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (d < 0) die(126, "open /dev/pts");
    struct statfs sf;
    if (fstatfs(d, &sf) < 0) die(126, "statfs /dev/pts");
    if (sf.f_type == DEVPTS_SUPER_MAGIC) { close(d); return; }
    if (flock(d, LOCK_EX) < 0) die(126, "lock /dev/pts");
    int cur = open("/dev/pts", O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (cur < 0) die(126, "open /dev/pts");
    if (fstatfs(cur, &sf) < 0) die(126, "statfs /dev/pts");
    if (sf.f_type != DEVPTS_SUPER_MAGIC) {
        if (sf.f_type != TMPFS_MAGIC) {
            errno = EPERM;
            die(126, "/dev/pts is not a directory of the sandbox's /dev");
        }
        int fs = (int)syscall(SYS_fsopen, "devpts", FSOPEN_CLOEXEC);
        if (fs < 0) die(126, "fsopen devpts");
        if (syscall(SYS_fsconfig, fs, FSCONFIG_SET_STRING, "ptmxmode", "0666", 0) < 0 ||
            syscall(SYS_fsconfig, fs, FSCONFIG_SET_STRING, "mode", "0620", 0) < 0 ||
            syscall(SYS_fsconfig, fs, FSCONFIG_CMD_CREATE, NULL, NULL, 0) < 0)
            die(126, "fsconfig devpts");
        int mnt = (int)syscall(SYS_fsmount, fs, FSMOUNT_CLOEXEC,
                               MOUNT_ATTR_NOSUID | MOUNT_ATTR_NOEXEC);
        if (mnt < 0) die(126, "fsmount devpts");
        close(fs);
        if (syscall(SYS_move_mount, mnt, "", cur, "",
                    MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH) < 0)
            die(126, "move_mount devpts at /dev/pts");
        close(mnt);
    }
    close(cur);
    close(d);   /* releases the lock */
}

static void setup_pty(uid_t uid, gid_t gid, int chown_it) {
    ensure_devpts();   /* a no-op (one statfs) once /dev/pts is a devpts */
    int m = open("/dev/pts/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (m < 0) die(126, "open /dev/pts/ptmx");
    struct stat st;
    if (fstat(m, &st) < 0 || !S_ISCHR(st.st_mode) || major(st.st_rdev) != 5
            || minor(st.st_rdev) != 2) {
        errno = ENOTTY;
        die(126, "/dev/pts/ptmx is not the pty multiplexer");
    }
    int unlock = 0;
    if (ioctl(m, TIOCSPTLCK, &unlock) < 0) die(126, "unlock the pty");
    struct winsize ws = {pty_rows ? pty_rows : 24, pty_cols ? pty_cols : 80, 0, 0};
    if (ioctl(m, TIOCSWINSZ, &ws) < 0) die(126, "TIOCSWINSZ");
    int s = ioctl(m, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (s < 0) die(126, "open the pty's terminal");
    if (chown_it && fchown(s, uid, gid) < 0) die(126, "chown the terminal");
    if (ioctl(s, TIOCSCTTY, 0) < 0) die(126, "TIOCSCTTY");
    char one = 'm';
    struct iovec iov = {&one, 1};
    union { char b[CMSG_SPACE(sizeof(int))]; struct cmsghdr align; } u;
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = u.b;
    msg.msg_controllen = sizeof u.b;
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &m, sizeof m);
    ssize_t w;
    while ((w = sendmsg(0, &msg, MSG_NOSIGNAL)) < 0 && errno == EINTR) {}
    if (w != 1) die(126, "hand the terminal to the edge");
    close(m);
    for (int k = 0; k < 3; k++)
        if (dup2(s, k) < 0) die(126, "dup2 the terminal");
    if (s > 2) close(s);
}

/* Open files one sandbox process may hold (soft = hard; red team 19, B5). The zygote
 * runs with the edge's raised RLIMIT_NOFILE (dsec.nofile.raise_nofile: the edge holds
 * fds for thousands of sandboxes) and every sandbox process inherited it, so one 4 GiB
 * sandbox could hold more open files than the node's whole file table (fs.file-max,
 * node-wide: full, every other tenant gets ENFILE). Each sandbox process (its init,
 * every exec, every helper-forked command, process-table starts) gets this limit before
 * its execve instead, so a sandbox holds at most pids_max x SANDBOX_NOFILE open files
 * (1,048,576 at the default pids_max 1,024; docs/container.md "Node budget"), and no
 * sandbox can raise it (raising a hard limit needs CAP_SYS_RESOURCE, never granted).
 * 1,024 is the soft limit most programs are written for (select(2)'s FD_SETSIZE). A
 * lower inherited hard limit is kept. Keep in step with
 * dsec.edge.backends.container.SANDBOX_NOFILE. */
#define SANDBOX_NOFILE 1024

/* Every signal's disposition back to the default and nothing blocked, just before a
 * sandbox's process starts: an ignored signal survives execve, and whatever started the
 * edge may have ignored some - nohup: SIGHUP; `dsec up &` from a script: SIGINT and
 * SIGQUIT (a Ctrl-C in the sandbox's terminal would do nothing); a parent started with
 * glibc's posix_spawn: 32 and 33, glibc's own, which its sigaction() refuses to touch
 * (CI found SigIgn 0x80000000 in a command's status) - hence the raw syscall. */
static void default_signals(void) {
    struct { void *handler; unsigned long flags; void *restorer; unsigned long mask; } dfl;
    memset(&dfl, 0, sizeof dfl);             /* handler 0: SIG_DFL */
    for (int s = 1; s <= 64; s++)
        if (s != SIGKILL && s != SIGSTOP) syscall(SYS_rt_sigaction, s, &dfl, NULL, 8);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
}

static void sandbox_rlimits(int fail_code) {
    struct rlimit r = {SANDBOX_NOFILE, SANDBOX_NOFILE}, cur;
    if (getrlimit(RLIMIT_NOFILE, &cur) == 0 && cur.rlim_max < r.rlim_max)
        r.rlim_cur = r.rlim_max = cur.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &r) < 0) die(fail_code, "setrlimit(RLIMIT_NOFILE, %d)",
                                              SANDBOX_NOFILE);
}

/* The command's process: visible inside from its birth, and already all inside. */
static int exec_final(void *arg) {
    const struct final_args *a = arg;
    const char *cwd = a->cwd, *user = a->user;
    int nenv = a->nenv;
    char **env = a->env, **target = a->target;
    await_go();
    default_signals();  /* the intermediate ignored SIGPIPE; the command gets defaults */
    if (setsid() < 0) die(126, "setsid");
    uid_t uid = 0;
    gid_t gid = 0;
    char home[1024];
    int switch_user = user[0] != 0;
    if (switch_user) lookup_user(user, &uid, &gid, home, sizeof home);
    if (chdir(cwd[0] ? cwd : "/") < 0) die(126, "chdir %s", cwd);
    if (pty_req) setup_pty(uid, gid, switch_user);
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
    if (a->hide[0]) hide_paths(a->hide);
    sandbox_rlimits(126);
    load_seccomp();
    exec_path(target, envp);
    return 126;
}

/* ---- exec helper: a warm intermediate per sandbox ------------------------------------
 *
 *   helper ncg cg...     (fds: 3 init pidfd, 4 seccomp BPF, 5 request socket, 6 report)
 *
 * The per-exec intermediate above pays, every exec, a fork of the zygote, the cgroup
 * joins, setns into six namespaces, the capability drop and the seccomp load, then its
 * exit and reap. A helper does all of that once per sandbox and then forks each exec's
 * command from there: it stays in the host's pid namespace (nothing inside can see or
 * signal it; its children are born in the sandbox's), in the sandbox's cgroups, with the
 * sandbox's capability set, no_new_privs and seccomp filter (inherited by every child:
 * the same filter the per-exec path loads), and non-dumpable. It was re-executed from
 * the zygote's binary before any of that, so its image is a few pages and forking it is
 * cheap. It holds nothing a command may not have but its request socket and the report
 * socket, both closed in the child before the go byte; the exec cgroup's procs files
 * arrive per request as fds the zygote opened. A child is CLONE_PARENT, so the zygote
 * reaps it and reports its exit exactly as for the per-exec path; the helper reports its
 * pid (report pid 0: it could not fork - at the task limit - and the edge falls back).
 * Start handshake as run_exec_final: nothing runs before the go byte.
 */
#define FD_HSOCK 5

/* flags: FWD_TRACK (a status pipe's write end follows the cgroup fds: the command's
 * failure to start is written there, its execve closes it - F_TRACK, as the per-exec
 * path's FD_STATUS_EXEC), FWD_PTY with cols << 4 and rows << 14 (F_PTY: the command on a
 * terminal of the sandbox's devpts; stdin is the socket its master goes back over). */
#define FWD_TRACK 1u
#define FWD_PTY 2u
struct fwd_hdr { uint32_t slot, gen, ncg, nstr, flags; };

static int helper_final(void *arg);
struct helper_args { char **s; int n; int ncg; int *cgfds; int stdio[3]; int status; };

/* 1 if the sandbox's /dev/pts is its devpts already. The first pty exec of an F_LAZYPTS
 * sandbox mounts it (ensure_devpts), which needs capabilities and syscalls the helper's
 * commands no longer have: until then a pty command is refused here (report 0) and the
 * edge takes the per-exec path, which mounts it. */
static int devpts_ready(void) {
    struct statfs sf;
    return statfs("/dev/pts", &sf) == 0 && sf.f_type == DEVPTS_SUPER_MAGIC;
}

static int do_helper(int argc, char **argv) {
    exec_mode = 1;
    exec_what = "(exec helper)";
    if (argc < 3) { errno = EINVAL; die(126, "usage"); }
    int ncg = atoi(argv[2]);
    if (ncg < 0 || 3 + ncg > argc) { errno = EINVAL; die(126, "usage"); }
    join_cgroups(ncg, &argv[3]);
    if (setns(FD_PIDFD, NS_ENTER | CLONE_NEWPID) < 0) die(126, "setns");
    close(FD_PIDFD);
    drop_caps();
    load_seccomp();
    signal(SIGPIPE, SIG_IGN);
    static char buf[1 << 17];
    static char *strs[4096];
    union { char b[CMSG_SPACE(64 * sizeof(int))]; struct cmsghdr align; } u;
    for (;;) {
        struct iovec iov = {buf, sizeof buf - 1};
        struct msghdr m = {0};
        m.msg_iov = &iov;
        m.msg_iovlen = 1;
        m.msg_control = u.b;
        m.msg_controllen = sizeof u.b;
        ssize_t r = recvmsg(FD_HSOCK, &m, MSG_CMSG_CLOEXEC);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) _exit(0);  /* the zygote is gone */
        int fds[64], nfds = 0;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c))
            if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
                int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
                for (int q = 0; q < k && nfds < 64; q++)
                    memcpy(&fds[nfds++], CMSG_DATA(c) + q * sizeof(int), sizeof(int));
            }
        struct fwd_hdr h;
        int have_hdr = (size_t)r >= sizeof h;
        int ok = have_hdr && !(m.msg_flags & (MSG_TRUNC | MSG_CTRUNC));
        int n = 0;
        if (have_hdr) {
            memcpy(&h, buf, sizeof h);
            my_slot = h.slot;
            my_gen = h.gen;
        }
        if (ok) {
            buf[r] = 0;
            for (size_t off = sizeof h; off < (size_t)r && n < 4095;) {
                char *z = memchr(buf + off, 0, (size_t)r - off);
                if (!z) { ok = 0; break; }
                strs[n++] = buf + off;
                off = (size_t)(z - buf) + 1;
            }
            strs[n] = NULL;
            int track = (h.flags & FWD_TRACK) != 0;
            ok = ok && (int)h.nstr == n && (int)h.ncg + 3 + track == nfds && h.ncg <= 32;
            pty_req = (h.flags & FWD_PTY) != 0;
            pty_cols = (unsigned short)((h.flags >> 4) & 1023);
            pty_rows = (unsigned short)((h.flags >> 14) & 1023);
            if (ok && pty_req && !devpts_ready()) ok = 0;  /* the per-exec path mounts it */
        }
        pid_t pid = 0;
        if (ok) {
            int st = (h.flags & FWD_TRACK) ? fds[3 + h.ncg] : -1;
            struct helper_args a = {strs, n, (int)h.ncg, &fds[3], {fds[0], fds[1], fds[2]}, st};
            if (pipe2(go_fds, O_CLOEXEC) == 0) {
                pid = clone_parent();
                if (pid == 0) _exit(helper_final(&a));
                if (pid < 0) pid = 0;
                /* Our copies of what the request brought go before the report (red team
                 * 22, C2): the zygote learns the command's pid only from it, so by the
                 * time it can see the command exit, its status pipe's one writer left is
                 * the command (gone at its execve) - we never hold it open behind a
                 * command that ended, however long we are throttled or frozen here. The
                 * status pipe first. */
                if (st >= 0) close(st);
                for (int k = 0; k < nfds; k++)
                    if (fds[k] != st) close(fds[k]);
                nfds = 0;
                close(go_fds[0]);
                if (pid) send_report(pid);
                if (pid && write(go_fds[1], "g", 1) < 0) {}
                close(go_fds[1]);
            }
        }
        for (int k = 0; k < nfds; k++) close(fds[k]);
        /* could not fork (or a malformed request): the edge takes the per-exec path */
        if (!pid && have_hdr) send_report(0);
    }
}

/* The command's process, forked by the helper (a copy of it: the helper goes on). */
static int helper_final(void *arg) {
    const struct helper_args *a = arg;
    /* first: a failure message (die) must not go down the request socket (fd 5) */
    close(FD_HSOCK);
    close(FD_REPORT);
    /* argv strings: cwd user nenv env... -- target... */
    /* F_TRACK: from here on a failure also goes to the status pipe (die writes
     * FD_STATUS_EXEC), and the execve closes it (CLOEXEC): then the zygote says Running.
     * Before the dup2s below: its number may be one of theirs. */
    if (a->status >= 0 && (dup2(a->status, FD_STATUS_EXEC) < 0
                           || fcntl(FD_STATUS_EXEC, F_SETFD, FD_CLOEXEC) < 0))
        die(126, "dup2");
    for (int k = 0; k < 3; k++)
        if (dup2(a->stdio[k], k) < 0) die(126, "dup2");
    for (int k = 0; k < a->ncg; k++)
        if (write(a->cgfds[k], "0", 1) < 0) die(126, "join the exec's cgroup");
    int keep = go_fds[0];
    /* nothing of the helper's reaches the command: request/report sockets, cgroup fds */
    if (dup2(keep, 3) < 0) die(126, "dup2");
    go_fds[0] = 3;
    syscall(SYS_close_range, 4, 4, 0);
    syscall(SYS_close_range, a->status >= 0 ? 6 : 5, ~0U, 0);
    go_fds[1] = -1;
    char c = 0;
    ssize_t r;
    while ((r = read(3, &c, 1)) < 0 && errno == EINTR) {}
    close(3);
    if (r != 1) { errno = ECHILD; die(126, "the exec helper died before the command started"); }
    default_signals();
    if (a->n < 4) { errno = EINVAL; die(126, "usage"); }
    const char *cwd = a->s[0], *user = a->s[1];
    int nenv = atoi(a->s[2]);
    if (nenv < 0 || 3 + nenv + 1 >= a->n || strcmp(a->s[3 + nenv], "--")) {
        errno = EINVAL;
        die(126, "usage");
    }
    char **env = &a->s[3], **target = &a->s[4 + nenv];
    exec_what = target[0];
    if (setsid() < 0) die(126, "setsid");
    uid_t uid = 0;
    gid_t gid = 0;
    char home[1024];
    int switch_user = user[0] != 0;
    if (switch_user) lookup_user(user, &uid, &gid, home, sizeof home);
    if (chdir(cwd[0] ? cwd : "/") < 0) die(126, "chdir %s", cwd);
    if (pty_req) setup_pty(uid, gid, switch_user);   /* its devpts is there (devpts_ready) */
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
    sandbox_rlimits(126);   /* the helper runs with the zygote's limit; its commands not */
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
 * target entered the namespace): a short-lived child unshares the user namespace (and
 * net, uts, ipc with it); we write its maps, open its namespaces and kill it - they live
 * on through the fds. We are the create's intermediate, in the host's pid namespace, so
 * the child's pid names its /proc entry. Measured: see docs/container.md. */
#define NS_OWNED (CLONE_NEWNET | CLONE_NEWUTS | CLONE_NEWIPC)
static const char *const ns_owned_names[3] = {"net", "uts", "ipc"};

static int make_userns(const char *base, const char *size, int owned[3]) {
    int sync[2];
    if (pipe2(sync, O_CLOEXEC) < 0) die(1, "pipe2");
    pid_t h = fork();
    if (h < 0) die(1, "fork (user namespace)");
    if (h == 0) {
        /* net, uts and ipc with it, owned by it: the sandbox's root may then bind ports
         * < 1024, use raw sockets and set its hostname - in its own namespaces only. */
        char ok = unshare(CLONE_NEWUSER | (netns_req ? NS_OWNED & ~CLONE_NEWNET : NS_OWNED)) == 0;
        if (write(sync[1], &ok, 1) != 1) _exit(1);
        for (;;) pause();
    }
    close(sync[1]);
    char ok = 0, path[96], map[96];
    ssize_t r = read(sync[0], &ok, 1);
    close(sync[0]);
    int fd = -1;
    snprintf(path, sizeof path, "/proc/%d", (int)h);
    if (r == 1 && ok) {
        int n = snprintf(map, sizeof map, "0 %s %s\n", base, size);
        snprintf(path, sizeof path, "/proc/%d/uid_map", (int)h);
        int m = open(path, O_WRONLY | O_CLOEXEC);
        int good = m >= 0 && write(m, map, (size_t)n) == n;
        if (m >= 0) close(m);
        snprintf(path, sizeof path, "/proc/%d/gid_map", (int)h);
        m = good ? open(path, O_WRONLY | O_CLOEXEC) : -1;
        good = m >= 0 && write(m, map, (size_t)n) == n;
        if (m >= 0) close(m);
        for (int k = 0; good && k < 3; k++) {
            snprintf(path, sizeof path, "/proc/%d/ns/%s", (int)h, ns_owned_names[k]);
            good = (owned[k] = open(path, O_RDONLY | O_CLOEXEC)) >= 0;
        }
        snprintf(path, sizeof path, "/proc/%d/ns/user", (int)h);
        if (good) fd = open(path, O_RDONLY | O_CLOEXEC);
    } else {
        errno = EPERM;
    }
    int saved = errno;
    kill(h, SIGKILL);  /* our own unreaped child: the pid cannot name anyone else */
    waitpid(h, NULL, 0);
    errno = saved;
    if (fd < 0) die(1, "user namespace with map '0 %s %s' (%s)", base, size, path);
    return fd;
}

/* Cover a lowerdir (in our private mount namespace) with an idmapped clone of itself:
 * files owned by host uid 0 there appear owned by the user namespace's root, and the
 * overlay - which reads lowers through these mounts - shows them so; copy-ups keep that
 * (mapped) owner. */
static void idmap_dir(const char *dir, int userns_fd) {
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

static int open_dir_path(const char *dir) {
    int fd = open(dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) die(1, "open %s", dir);
    return fd;
}

/* The overlay root, named by fd: overlayfs shows its options in mountinfo exactly as
 * given (checked on 6.18), so "lowerdir=/proc/self/fd/7:..." keeps the state dir, the
 * layer store and the upper/work paths out of the sandbox's /proc/self/mountinfo. The
 * short names also keep many layers under the one-page option limit. */
static void mount_overlay(int nlower, char **lowers, const char *upper, const char *work,
                          int userns_fd) {
    char opts[4096];
    int fds[512], nfd = 0;
    size_t n = 0;
    if (nlower < 1 || nlower > 500) { errno = EINVAL; die(1, "%d lower layers", nlower); }
    n += (size_t)snprintf(opts + n, sizeof opts - n, "lowerdir=");
    for (int k = 0; k < nlower; k++) {
        if (userns_fd >= 0) idmap_dir(lowers[k], userns_fd);
        fds[nfd] = open_dir_path(lowers[k]);
        n += (size_t)snprintf(opts + n, n < sizeof opts ? sizeof opts - n : 0,
                              "%s/proc/self/fd/%d", k ? ":" : "", fds[nfd]);
        nfd++;
    }
    fds[nfd] = open_dir_path(upper);
    int ufd = fds[nfd++];
    fds[nfd] = open_dir_path(work);
    int wfd = fds[nfd++];
    n += (size_t)snprintf(opts + n, n < sizeof opts ? sizeof opts - n : 0,
                          ",upperdir=/proc/self/fd/%d,workdir=/proc/self/fd/%d"
                          /* dsec.image.compose.OVERLAY_FLAGS: never write or follow redirect
                           * or metacopy xattrs, whatever the host's overlay module defaults
                           * are (an upper dir becomes a lower layer through pack_diff) */
                          ",redirect_dir=nofollow,metacopy=off", ufd, wfd);
    if (n >= sizeof opts) { errno = E2BIG; die(1, "overlay options for %d layers", nlower); }
    xmount("overlay", root_path, "overlay", MS_NODEV, opts);
    for (int k = 0; k < nfd; k++) close(fds[k]);
}

/* The part of the root the intermediate builds: everything that does not depend on the
 * pid namespace (overlay, /dev, /tmp, /sys - sysfs follows the network namespace). */
static void build_root_outer(int nlower, char **lowers, const char *upper, const char *work,
                             long long tmp_bytes, int userns_fd, const char *sysfs_src,
                             const char *scratch_src) {
    char p[8192], opts[256];
    xmount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL);
    mount_overlay(nlower, lowers, upper, work, userns_fd);
    static const char *subdirs[] = {"/proc", "/dev", "/sys", "/tmp"};
    for (size_t k = 0; k < 4; k++) xmkdir(at_root(subdirs[k]), 0755);
    char dev[4200];
    snprintf(dev, sizeof dev, "%s/dev", root_path);
    /* One tmpfs ("scratch") for /dev, /dev/shm, /tmp and the masks below, where there
     * were four: every superblock on the host costs EVERY memory cgroup a shrinker slot
     * (the kernel's per-memcg shrinker_info grows with the highest shrinker id and never
     * shrinks), so superblocks-per-sandbox x sandboxes is the term that grew the
     * per-sandbox kernel memory with the sandbox count (issue 22; docs/container.md,
     * Density). It is made detached (fsopen/fsmount) and only its dev/ and tmp/ dirs are
     * attached (open_tree clones), so neither shows the other; /dev/shm is a bind of
     * dev/shm with nosuid,nodev,noexec. Its size is what the three had: 64 KiB + the
     * /dev/shm size + tmp_bytes, now shared (all of it is charged to the sandbox's
     * memory cgroup either way). */
    {
        char tmp[4200];
        snprintf(tmp, sizeof tmp, "%s/tmp", root_path);
        int scratch;
        if (scratch_src) {
            /* F_SCRATCH: this sandbox's empty directory (made 0700 by the edge) of the
             * node's ONE scratch tmpfs, instead of a tmpfs of its own - one superblock
             * less per sandbox (docs/container.md, Density: "shared scratch"). Only its
             * dev/ and tmp/ are attached below, so nothing above them is reachable;
             * the bytes are charged to this sandbox's memory cgroup as before (the
             * writer's), and the shared tmpfs has no size or inode cap another sandbox
             * could exhaust (the memory limit is the bound). */
            scratch = open(scratch_src, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            if (scratch < 0) die(1, "open the shared scratch dir %s", scratch_src);
        } else {
            int fs = (int)syscall(SYS_fsopen, "tmpfs", FSOPEN_CLOEXEC);
            if (fs < 0) die(1, "fsopen tmpfs");
            /* tmp_bytes < 0: the whole tmpfs is -tmp_bytes, with one inode per KiB of it
             * at most (a memory group's member: what no OOM kill frees - file pages and
             * inodes - stays inside its own budget, red team 27 E/M) */
            long long total = tmp_bytes < 0 ? -tmp_bytes
                                            : (long long)DSEC_SHM_BYTES + (64 << 10) + tmp_bytes;
            char inodes[32];
            snprintf(inodes, sizeof inodes, "%lld", total / 1024 > 256 ? total / 1024 : 256);
            snprintf(opts, sizeof opts, "%lld", total);
            if (syscall(SYS_fsconfig, fs, FSCONFIG_SET_STRING, "source", "tmpfs", 0) < 0 ||
                syscall(SYS_fsconfig, fs, FSCONFIG_SET_STRING, "size", opts, 0) < 0 ||
                (tmp_bytes < 0 &&
                 syscall(SYS_fsconfig, fs, FSCONFIG_SET_STRING, "nr_inodes", inodes, 0) < 0) ||
                syscall(SYS_fsconfig, fs, FSCONFIG_SET_STRING, "mode", "755", 0) < 0 ||
                syscall(SYS_fsconfig, fs, FSCONFIG_CMD_CREATE, NULL, NULL, 0) < 0)
                die(1, "fsconfig tmpfs size=%s", opts);
            scratch = (int)syscall(SYS_fsmount, fs, FSMOUNT_CLOEXEC, MOUNT_ATTR_NOSUID);
            if (scratch < 0) die(1, "fsmount tmpfs");
            close(fs);
        }
        if (mkdirat(scratch, "dev", 0755) < 0 || fchmodat(scratch, "dev", 0755, 0) < 0 ||
            mkdirat(scratch, "tmp", 01777) < 0 || fchmodat(scratch, "tmp", 01777, 0) < 0)
            die(1, "mkdir in the scratch tmpfs");
        static const char *sub[2] = {"dev", "tmp"};
        const char *at[2] = {dev, tmp};
        unsigned long fl[2] = {MS_NOSUID, MS_NOSUID | MS_NODEV};
        for (int k = 0; k < 2; k++) {
            int t = (int)syscall(SYS_open_tree, scratch, sub[k], OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
            if (t < 0) die(1, "open_tree scratch/%s", sub[k]);
            if (syscall(SYS_move_mount, t, "", AT_FDCWD, at[k], MOVE_MOUNT_F_EMPTY_PATH) < 0)
                die(1, "move_mount %s", at[k]);
            close(t);
            xmount(NULL, at[k], NULL, MS_BIND | MS_REMOUNT | fl[k], NULL);
        }
        close(scratch);
    }
    for (size_t k = 0; k < sizeof DSEC_DEVICES / sizeof DSEC_DEVICES[0]; k++) {
        snprintf(p, sizeof p, "%s/%s", dev, DSEC_DEVICES[k].name);
        if (mknod(p, S_IFCHR | DSEC_DEVICES[k].mode,
                  makedev(DSEC_DEVICES[k].major, DSEC_DEVICES[k].minor)) < 0)
            die(1, "mknod %s", p);
        if (chmod(p, DSEC_DEVICES[k].mode) < 0) die(1, "chmod %s", p);
    }
    snprintf(p, sizeof p, "%s/pts", dev);
    xmkdir(p, 0755);
    if (!lazypts_req)   /* F_LAZYPTS: the first pty exec mounts it (ensure_devpts) */
        xmount("devpts", p, "devpts", MS_NOSUID | MS_NOEXEC,
               "newinstance,ptmxmode=0666,mode=0620");
    snprintf(p, sizeof p, "%s/ptmx", dev);
    if (symlink("pts/ptmx", p) < 0) die(1, "symlink %s", p);
    snprintf(p, sizeof p, "%s/shm", dev);
    xmkdir(p, 01777);
    if (chmod(p, 01777) < 0) die(1, "chmod %s", p);   /* mkdir applies the umask */
    xmount(p, p, NULL, MS_BIND, NULL);
    xmount(NULL, p, NULL, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    snprintf(p, sizeof p, "%s/.mask", dev);    /* the masks' empty dir (build_root_inner) */
    xmkdir(p, 0555);
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
    xmount(init_bin, p, NULL, MS_BIND, NULL);
    xmount(NULL, p, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, NULL);
    if (sysfs_src) {
        /* F_SYSFS: the node's one read-only sysfs of an empty network namespace (it shows
         * that namespace's lo, never the host's or another sandbox's interfaces), bound
         * here instead of a sysfs of our own: each superblock per sandbox costs every
         * memory cgroup a shrinker slot (docs/container.md, Density). */
        xmount(sysfs_src, at_root("/sys"), NULL, MS_BIND, NULL);
        xmount(NULL, at_root("/sys"), NULL,
               MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    } else {
        xmount("sysfs", at_root("/sys"), "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
               NULL);
    }
}

/* F_IPCCAPS (a memory group's member, dsec.edge.memgroups): cap its ipc namespace's SysV
 * objects - "shmmax=N;shmall=N;msgmnb=N;msgmni=N;sem=A B C D", computed by the edge
 * (density.ipc_caps). The ipc sysctls are the writer's ipc namespace's, and PID 1 is in
 * the sandbox's. They are written through the procfs PID 1 has just mounted, before the
 * masks make /proc/sys read-only and before any tenant code: through the host's /proc
 * every namespace's ipc sysctl files are dentries of one name under one parent, so the
 * first lookup in a new namespace walked one hash chain as long as the number of
 * namespaces on the host (measured: ~2 ms per file at 3,000, 16 ms at 5,000 - creates
 * with groups fell to 12/s at 10,000); a fresh procfs has its own dentries (~20 us at
 * any count). Only these five names are ever written. */
static void write_ipc_caps(void) {
    static const char *allowed[] = {"shmmax", "shmall", "msgmnb", "msgmni", "sem"};
    char buf[512], path[8192];
    if (strlen(ipc_caps) >= sizeof buf) { errno = E2BIG; die(1, "ipc caps"); }
    snprintf(buf, sizeof buf, "%s", ipc_caps);
    char *save = NULL;
    for (char *item = strtok_r(buf, ";", &save); item; item = strtok_r(NULL, ";", &save)) {
        char *eq = strchr(item, '=');
        if (!eq) { errno = EINVAL; die(1, "ipc cap %s", item); }
        *eq = 0;
        const char *value = eq + 1;
        int ok = 0;
        for (size_t k = 0; k < sizeof allowed / sizeof allowed[0]; k++)
            ok |= strcmp(item, allowed[k]) == 0;
        if (!ok || !*value || strspn(value, "0123456789 ") != strlen(value)) {
            errno = EINVAL;
            die(1, "ipc cap %s=%s (only shmmax, shmall, msgmnb, msgmni, sem with numbers)",
                item, value);
        }
        snprintf(path, sizeof path, "%s/sys/kernel/%s", at_root("/proc"), item);
        int fd = open(path, O_WRONLY | O_CLOEXEC);
        if (fd < 0) die(1, "cannot cap kernel.%s of the sandbox's ipc namespace", item);
        ssize_t n = write(fd, value, strlen(value));
        if (n != (ssize_t)strlen(value)) {
            if (n >= 0) errno = EIO;
            die(1, "cannot cap kernel.%s of the sandbox's ipc namespace", item);
        }
        close(fd);
    }
}

/* The part PID 1 of the new pid namespace builds: /proc (procfs shows the pid namespace
 * of whoever mounts it), the masks over /proc and /sys paths, then pivot_root. */
static void build_root_inner(void) {
    char p[8192], q[8192];
    xmount("proc", at_root("/proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    if (ipc_caps) write_ipc_caps();
    snprintf(q, sizeof q, "%s/dev/null", root_path);
    for (size_t k = 0; k < sizeof DSEC_MASKED_FILES / sizeof DSEC_MASKED_FILES[0]; k++) {
        snprintf(p, sizeof p, "%s", at_root(DSEC_MASKED_FILES[k]));
        if (exists(p)) xmount(q, p, NULL, MS_BIND, NULL);
    }
    /* An empty directory of the sandbox's /dev tmpfs, bound read-only over every masked
     * directory and then removed from /dev: the binds keep the deleted directory, in
     * which nothing can be created (ENOENT), so each mask is an empty read-only dir with
     * no superblock of its own (each superblock per sandbox costs every memory cgroup a
     * shrinker slot, and adds to the per-memcg list_lru reparenting work of every
     * sandbox cgroup removal - measured: that walk dominated destroy at 1,500 sandboxes;
     * binds add none). It was a tmpfs of its own per sandbox. */
    char mask[8192];
    snprintf(mask, sizeof mask, "%s/dev/.mask", root_path);
    for (size_t k = 0; k < sizeof DSEC_MASKED_DIRS / sizeof DSEC_MASKED_DIRS[0]; k++) {
        snprintf(p, sizeof p, "%s", at_root(DSEC_MASKED_DIRS[k]));
        if (!is_dir(p)) continue;
        xmount(mask, p, NULL, MS_BIND, NULL);
        xmount(NULL, p, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
               | MS_NOEXEC, NULL);
    }
    if (rmdir(mask) < 0) die(1, "rmdir %s", mask);
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

static int create_init(void *arg);

static int do_create(int argc, char **argv) {
    /* argv: create root nlower lower... upper work hostname loopback tmp_bytes ncg cg...
     *       [uid_base uid_count: with F_USERNS] [shared sysfs path: with F_SYSFS]
     *       [this sandbox's shared scratch dir: with F_SCRATCH] [ipc caps: F_IPCCAPS] */
    status_fd = FD_STATUS_CREATE;
    fcntl(status_fd, F_SETFD, FD_CLOEXEC);
    syscall(SYS_close_range, FD_REPORT + 1, ~0U, 0);
    int i = 2;
    if (argc < 4) { errno = EINVAL; die(1, "usage"); }
    snprintf(root_path, sizeof root_path, "%s", argv[i++]);
    int nlower = atoi(argv[i++]);
    if (nlower < 1 || i + nlower + 6 > argc) { errno = EINVAL; die(1, "usage"); }
    char **lowers = &argv[i];
    i += nlower;
    const char *upper = argv[i++], *work = argv[i++], *hostname = argv[i++];
    int loopback = atoi(argv[i++]);
    long long tmp_bytes = atoll(argv[i++]);
    int ncg = atoi(argv[i++]);
    if (ncg < 0 || i + ncg + (userns_req ? 2 : 0) + (sysfs_req ? 1 : 0)
            + (scratch_req ? 1 : 0) + (ipccaps_req ? 1 : 0) != argc) {
        errno = EINVAL;
        die(1, "usage");
    }
    int tail = argc;
    ipc_caps = ipccaps_req ? argv[--tail] : NULL;
    const char *scratch_src = scratch_req ? argv[--tail] : NULL;
    const char *sysfs_src = sysfs_req ? argv[--tail] : NULL;
    char **cgs = &argv[i];
    i += ncg;
    /* Intermediate (host pid namespace): cgroups, then every namespace but pid. */
    join_cgroups(ncg, cgs);
    int unshared = NS_ENTER;
    int userns_fd = -1;
    if (netns_req) {
        /* The edge's slot: a netns owned by the host's user namespace, joined before any
         * user namespace exists, so the sandbox's root never holds CAP_NET_ADMIN over it
         * (it cannot change its address, routes or the router's rules). 54 us vs 368 us
         * for a fresh unshare (plan-14 E6, E13). */
        if (setns(FD_NETNS, CLONE_NEWNET) < 0) die(1, "setns(slot netns)");
        close(FD_NETNS);
        unshared &= ~CLONE_NEWNET;
    }
    if (userns_req) {
        int owned[3] = {-1, -1, -1};
        userns_fd = make_userns(argv[i], argv[i + 1], owned);
        for (int k = 0; k < 3; k++) {  /* we stay host root until the end: we may join */
            if (setns(owned[k], 0) < 0) die(1, "setns(%s)", ns_owned_names[k]);
            close(owned[k]);
        }
        unshared &= ~NS_OWNED;
    }
    if (unshare(unshared) < 0) die(1, "unshare(0x%x)", unshared);
    umask(0);
    build_root_outer(nlower, lowers, upper, work, tmp_bytes, userns_fd, sysfs_src,
                     scratch_src);
    if (sethostname(hostname, strnlen(hostname, 64)) < 0) die(1, "sethostname");
    if (loopback) loopback_up();
    if (unshare(CLONE_NEWPID) < 0) die(1, "unshare(CLONE_NEWPID)");
    run_init(create_init, &userns_fd);
    return 1;
}

/* PID 1 of the sandbox's pid namespace (sharing the intermediate's memory until its
 * execve: see run_init). */
static int create_init(void *arg) {
    int userns_fd = *(int *)arg;
    close(FD_REPORT);
    build_root_inner();
    umask(022);
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
    sandbox_rlimits(1);
    load_seccomp();
    /* Nothing but stdio and the (close-on-exec) status pipe may reach the init. */
    syscall(SYS_close_range, FD_BPF, ~0U, 0);
    default_signals();
    char *init_argv[] = {"/dev/.init", "-P", NULL};
    char *init_env[] = {"PATH=/bin", NULL};
    execve("/dev/.init", init_argv, init_env);
    die(1, "execve /dev/.init");
    return 1;
}

/* ---- serve: the zygote ------------------------------------------------------------ */

/* One zygote serves every sandbox of the node, so it never sleeps on anything a
 * sandbox-side process (intermediate, init, exec helper, command) holds: those run in the
 * sandbox's cgroups - cpu-throttled, SCHED_IDLE, frozen by a pause (red team 22, C2).
 * Every call on such a thing is non-blocking: status pipes are O_NONBLOCK on our side
 * (status_pipe) and read on their epoll event or after the writer's exit (EAGAIN = no
 * word); reports are recv(MSG_DONTWAIT); requests go to an exec helper with
 * sendmsg(MSG_DONTWAIT) (a full queue of a frozen helper is Failed: the per-exec path);
 * children are waited for with WNOHANG, followed by pidfd/signalfd events; kills are
 * pidfd_send_signal/kill. ns_pid_of reads /proc/<pid>/status of our own unreaped child
 * waiting for its go byte (no lock a sandbox process can hold; not its mm lock). The one
 * blocking wait is send_reply's poll on the edge's socket - the host edge, not a sandbox.
 */

/* Wire format (SOCK_SEQPACKET, one message each way per event; see protocol.py).
 * Request: struct req_hdr, then NUL-terminated strings = the exec/create argv above
 * (without the binary name). fds: exec -> [init pidfd, stdin, stdout, stderr];
 * create -> none, or [slot netns] with F_NETNS; kill -> none.
 * Reply: struct rep_hdr, then `len` bytes of message (Failed); Created carries a pidfd.
 * Exited.pid is the command's pid, or 0 when the intermediate died before forking it. */
enum { REQ_CREATE = 1, REQ_EXEC = 2, REQ_KILL = 3, REQ_HELPER = 4 };
enum { REP_CREATED = 1, REP_STARTED = 2, REP_EXITED = 3, REP_FAILED = 4, REP_RUNNING = 5 };
/* F_TRACK (a foreground exec the edge keeps as a process, issue 19): a status pipe as a
 * background exec has; once its command runs (the pipe read EOF at its execve) the
 * zygote sends Running with its host and namespace pids, or Failed with the reason it
 * could not start - then Exited as for any foreground exec. F_PTY: the command gets a
 * terminal of its own inside the sandbox (setup_pty); its size rides in the flags' top
 * bits: cols in 12..21, rows in 22..31. */
enum { F_BACKGROUND = 1, F_NESTED = 2, F_USERNS = 4, F_NETNS = 8, F_HELPER = 16,
       F_TRACK = 32, F_PTY = 64, F_SYSFS = 128,
       F_SCRATCH = 256, F_LAZYPTS = 512, F_IPCCAPS = 1024 };
struct req_hdr { uint32_t type, flags; uint64_t id; };
struct rep_hdr { uint32_t type; int32_t pid; uint64_t id; int32_t ns_pid, status, err; uint32_t len; };

/* One in-flight request. A slot lives until its reply is sent and every child we must
 * reap for it is reaped; `gen` changes on reuse, so stale epoll events and reports are
 * recognised. Epoll tags: gen << 32 | slot << 2 | what (what 3 = the fixed fds). */
enum { J_FREE = 0, J_FG, J_BG, J_CREATE, J_HELPER };
enum { W_STATUS = 0, W_MID = 1, W_FINAL = 2, W_FIXED = 3 };
enum { T_SOCK = 0, T_SIG = 1, T_REPORT = 2 };
struct job {
    int kind;
    uint32_t gen;
    uint64_t id;
    pid_t mid;          /* the intermediate; 0 once reaped */
    int mid_fd;         /* its pidfd (epoll), -1 once reaped */
    pid_t pid;          /* the final process (from the report); 0 before */
    int pid_fd;         /* its pidfd: FG exec (epoll: exit), create (handed to the edge) */
    int final_done;     /* FG: the final process was reaped */
    int final_status;   /* FG: its wait status */
    int status_fd;      /* create / BG exec: status pipe; -1 once read */
    int eof;            /* the status pipe read EOF (success, pending the report) */
    int replied;        /* the last reply for this request was sent */
    int killed;         /* Kill arrived: kill the final process as soon as it is known */
    int ns_pid;         /* BG: the command's pid inside */
    int pend;           /* counted in pending_mids: its report has not come */
    uint32_t via, via_gen; /* FG sent to an exec helper: that helper's slot + 1, gen */
    int hsock;          /* J_HELPER: our end of its request socket */
    int track;          /* FG with F_TRACK: Running/Failed once the command runs */
    int track_done;     /* ... and that reply was sent */
};
static struct job *jobs;
static size_t njobs;
static int sock = -1, epfd = -1, sigfd = -1, devnull = -1;
static int rep_fds[2] = {-1, -1};
static int bpf_fds[2] = {-1, -1};
static int pending_mids = 0;   /* intermediates not yet reported nor reaped */
static int sweep_deferred = 0;

/* Pids of our children nobody waits on for a status (inits, background commands):
 * reaped by sweep(). Sorted, for binary search. `id` is the create request's id for an
 * init (its exit is reported to the edge as Exited with that id, so the edge holds no
 * descriptor per idle sandbox to learn of its death - issue 22), 0 for the rest. */
struct reap { pid_t pid; uint64_t id; };
static struct reap *reapable;
static size_t nreapable, capreapable;

static size_t reapable_pos(pid_t p) {
    size_t lo = 0, hi = nreapable;
    while (lo < hi) {
        size_t m = (lo + hi) / 2;
        if (reapable[m].pid < p) lo = m + 1; else hi = m;
    }
    return lo;
}
static void reapable_add(pid_t p, uint64_t id) {
    size_t k = reapable_pos(p);
    if (k < nreapable && reapable[k].pid == p) return;
    if (nreapable == capreapable) {
        size_t n = capreapable ? capreapable * 2 : 256;
        struct reap *r = realloc(reapable, n * sizeof *r);
        if (!r) return;  /* then sweep() reaps it as an orphan once nothing is pending */
        reapable = r;
        capreapable = n;
    }
    memmove(reapable + k + 1, reapable + k, (nreapable - k) * sizeof *reapable);
    reapable[k].pid = p;
    reapable[k].id = id;
    nreapable++;
}
/* 1 and the entry's id if `p` is one of ours nobody waits on (removed), else 0. */
static int reapable_take(pid_t p, uint64_t *id) {
    size_t k = reapable_pos(p);
    if (k >= nreapable || reapable[k].pid != p) return 0;
    *id = reapable[k].id;
    memmove(reapable + k, reapable + k + 1, (nreapable - k - 1) * sizeof *reapable);
    nreapable--;
    return 1;
}

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

/* A status pipe (create, BG exec, F_TRACK): its write end goes to processes that live in a
 * sandbox's cgroups (intermediate, init, exec helper, command) - throttled by its cpu
 * quota, SCHED_IDLE, or frozen by a pause for as long as it stays paused. The zygote
 * serves every sandbox of the node, so it must never sleep on such a process: our read
 * end is O_NONBLOCK (the write end stays blocking: die()'s one short write). */
static int status_pipe(int sp[2]) {
    if (pipe2(sp, O_CLOEXEC) < 0) return -1;
    if (fcntl(sp[0], F_SETFL, O_NONBLOCK) < 0) {
        int e = errno;
        close(sp[0]);
        close(sp[1]);
        sp[0] = sp[1] = -1;
        errno = e;
        return -1;
    }
    return 0;
}

static uint64_t tag(struct job *j, int what) {
    return ((uint64_t)j->gen << 32) | ((uint64_t)(j - jobs) << 2) | (uint64_t)what;
}

static int watch(int fd, uint64_t t) {
    struct epoll_event ev = {EPOLLIN, {.u64 = t}};
    return epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &ev);
}

static void unwatch_close(int *fd) {
    if (*fd < 0) return;
    epoll_ctl(epfd, EPOLL_CTL_DEL, *fd, NULL);
    close(*fd);
    *fd = -1;
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

static void maybe_free(struct job *j) {
    if (!j->replied || j->mid || j->status_fd >= 0) return;
    if (j->kind == J_FG && j->pid && !j->final_done) return;
    if (j->pid_fd >= 0) unwatch_close(&j->pid_fd);
    uint32_t gen = j->gen + 1;
    memset(j, 0, sizeof *j);
    j->gen = gen;
    j->kind = J_FREE;
}

static int pidfd_signal(int fd, int sig) {
    return (int)syscall(SYS_pidfd_send_signal, fd, sig, NULL, 0);
}

/* Create / BG exec: both the status pipe and the report (or the intermediate's death) are
 * in; answer. */
static void finish_start(struct job *j, const char *msg) {
    if (j->replied) return;
    if (msg && msg[0]) {
        send_reply(REP_FAILED, j->id, j->pid, 0, 0, 0, msg, -1);
    } else if (j->killed) {
        send_reply(REP_FAILED, j->id, j->pid, 0, 0, ECANCELED,
                   "the exec was killed before its command started", -1);
    } else if (!j->pid) {
        send_reply(REP_FAILED, j->id, 0, 0, 0, ECHILD,
                   j->kind == J_CREATE ? "the sandbox's start helper died before its init"
                                       : "the exec helper died before the command started",
                   -1);
    } else if (j->kind == J_BG) {
        send_reply(REP_STARTED, j->id, j->pid, j->ns_pid, 0, 0, NULL, -1);
    } else if (j->pid_fd < 0) {
        send_reply(REP_FAILED, j->id, j->pid, 0, 0, errno, "pidfd_open of the sandbox's init", -1);
    } else {
        send_reply(REP_CREATED, j->id, j->pid, j->pid, 0, 0, NULL, j->pid_fd);
        close(j->pid_fd);
        j->pid_fd = -1;
    }
    j->replied = 1;
}

static void track_running(struct job *j) {
    if (j->track_done || j->replied) return;
    j->track_done = 1;
    send_reply(REP_RUNNING, j->id, j->pid, j->ns_pid, 0, 0, NULL, -1);
}

/* F_TRACK: its status pipe was read (`msg`: why it could not start; NULL: EOF). */
static void drain_reports(void);
static void track_status(struct job *j, const char *msg) {
    if (msg && msg[0]) {
        if (!j->track_done && !j->replied)
            send_reply(REP_FAILED, j->id, j->pid, 0, 0, 0, msg, -1);
        j->track_done = 1;
        return;
    }
    drain_reports();
    if (j->pid) track_running(j);
}

static void on_report(const struct report *r) {
    if (r->slot >= njobs) return;
    struct job *j = &jobs[r->slot];
    if (j->kind == J_FREE || j->gen != r->gen || j->pid || r->pid < 0) return;
    if (r->pid == 0) {  /* an exec helper could not fork the command: it never ran */
        if (!j->via || j->replied) return;
        if (j->pend) { pending_mids--; j->pend = 0; }
        if (sweep_deferred) sweep_deferred = 2;
        send_reply(REP_FAILED, j->id, 0, 0, 0, EAGAIN,
                   "the exec helper could not fork the command", -1);
        j->replied = 1;
        maybe_free(j);
        return;
    }
    j->pid = r->pid;
    if (j->pend) { pending_mids--; j->pend = 0; }
    /* An unreaped child of ours: its pid cannot be reused, so this pidfd is exact. */
    if (j->kind == J_FG) {
        j->pid_fd = (int)syscall(SYS_pidfd_open, j->pid, 0);
        if (j->pid_fd >= 0) {
            fcntl(j->pid_fd, F_SETFD, FD_CLOEXEC);
            watch(j->pid_fd, tag(j, W_FINAL));
        }
        if (j->killed) {
            if (j->pid_fd >= 0) pidfd_signal(j->pid_fd, SIGKILL);
            else kill(j->pid, SIGKILL);
        }
        if (j->track) {
            j->ns_pid = ns_pid_of(j->pid);  /* unreaped (it waits for its go byte) */
            if (j->eof) track_running(j);
        }
        return;  /* without a pidfd (EMFILE) sweep() finds its exit */
    }
    reapable_add(j->pid, j->kind == J_CREATE ? j->id : 0);
    if (j->kind == J_BG) {
        if (j->killed) kill(j->pid, SIGKILL);  /* unreaped child: exact */
        j->ns_pid = ns_pid_of(j->pid);
    } else {
        j->pid_fd = (int)syscall(SYS_pidfd_open, j->pid, 0);
        if (j->pid_fd >= 0) fcntl(j->pid_fd, F_SETFD, FD_CLOEXEC);
    }
    if (j->eof) {
        finish_start(j, NULL);
        maybe_free(j);
    }
}

static void drain_reports(void) {
    struct report r;
    ssize_t n;
    int any = 0;
    while ((n = recv(rep_fds[0], &r, sizeof r, MSG_DONTWAIT)) == (ssize_t)sizeof r) {
        on_report(&r);
        any = 1;
    }
    if (any && sweep_deferred) sweep_deferred = 2;
}

/* FG: Exited once both the command and its intermediate are reaped, so the exec's
 * cgroup holds neither when the edge removes it. */
static void fg_exited(struct job *j) {
    if (j->replied || !j->final_done || j->mid) return;
    if (j->track && j->status_fd >= 0) {
        /* Its exit came before its status pipe's event; Running or Failed go before
         * Exited. The command wrote its failure (if any, one write) before exiting, so
         * what it said is in the pipe now. Another writer may still hold the pipe - an
         * exec helper between its fork and its close (it closes before its report since
         * red team 22's C2, but a pipe a sandbox-side process holds must never stall the
         * node) - so the read is non-blocking: EAGAIN is "nothing written", as EOF is
         * (Running, then Exited: what the per-exec path says of a command that died
         * before its execve without a word). */
        char msg[4096];
        ssize_t n;
        while ((n = read(j->status_fd, msg, sizeof msg - 1)) < 0 && errno == EINTR) {}
        msg[n > 0 ? n : 0] = 0;
        unwatch_close(&j->status_fd);
        j->eof = 1;
        track_status(j, n > 0 ? msg : NULL);
    }
    send_reply(REP_EXITED, j->id, j->pid, j->pid, j->final_status, 0, NULL, -1);
    j->replied = 1;
}

/* An exec helper is gone (the sandbox went, or it was OOM-killed): execs sent to it that
 * have no command yet never ran - Failed, and the edge runs them the per-exec way. */
static void helper_exited(struct job *h, int st) {
    uint32_t slot = (uint32_t)(h - jobs) + 1;
    for (size_t k = 0; k < njobs; k++) {
        struct job *j = &jobs[k];
        if (j->kind != J_FG || j->via != slot || j->via_gen != h->gen || j->pid
                || j->replied) continue;
        if (j->pend) { pending_mids--; j->pend = 0; }
        send_reply(REP_FAILED, j->id, 0, 0, 0, ESRCH, "the exec helper is gone", -1);
        j->replied = 1;
        maybe_free(j);
    }
    if (sweep_deferred) sweep_deferred = 2;
    if (h->hsock >= 0) { close(h->hsock); h->hsock = -1; }
    send_reply(REP_EXITED, h->id, 0, 0, st, 0, NULL, -1);
    h->replied = 1;
    maybe_free(h);
}

static void on_mid_exit(struct job *j) {
    if (!j->mid) return;
    int st = 0;
    pid_t r = waitpid(j->mid, &st, WNOHANG);
    if (r == 0) return;  /* not yet (a stale wakeup) */
    drain_reports();     /* a report it sent just before exiting */
    unwatch_close(&j->mid_fd);
    j->mid = 0;
    if (j->kind == J_HELPER) { helper_exited(j, st); return; }
    if (!j->pid) {
        if (j->pend) { pending_mids--; j->pend = 0; }
        if (sweep_deferred) sweep_deferred = 2;
        if (j->kind == J_FG) {  /* it failed (message on stderr) or was killed */
            send_reply(REP_EXITED, j->id, 0, 0, st, 0, NULL, -1);
            j->replied = 1;
        } else if (j->eof) {
            finish_start(j, NULL);
        }
    }
    if (j->kind == J_FG) fg_exited(j);
    maybe_free(j);
}

static void on_final_exit(struct job *j) {
    if (!j->pid || j->final_done) return;
    int st = 0;
    if (waitpid(j->pid, &st, WNOHANG) == 0) return;
    j->final_done = 1;
    j->final_status = st;
    unwatch_close(&j->pid_fd);
    fg_exited(j);
    maybe_free(j);
}

static void on_status(struct job *j) {
    char msg[4096];
    ssize_t n;
    while ((n = read(j->status_fd, msg, sizeof msg - 1)) < 0 && errno == EINTR) {}
    if (n < 0 && errno == EAGAIN) return;  /* nothing yet (non-blocking: status_pipe) */
    msg[n > 0 ? n : 0] = 0;
    unwatch_close(&j->status_fd);
    j->eof = 1;
    if (j->kind == J_FG) {  /* F_TRACK: the command runs, or could not start */
        track_status(j, n > 0 ? msg : NULL);
        maybe_free(j);
        return;
    }
    if (n > 0) {
        finish_start(j, msg);
    } else {
        drain_reports();
        if (j->pid || !j->mid) finish_start(j, NULL);
    }
    maybe_free(j);
}

static struct job *job_of_pid(pid_t p) {
    for (size_t k = 0; k < njobs; k++)
        if (jobs[k].kind != J_FREE && (jobs[k].mid == p || jobs[k].pid == p)) return &jobs[k];
    return NULL;
}

/* Reap, one by one, the children we know that have exited: what sweep() does when a child
 * it cannot place yet blocks waitid(P_ALL) (which always returns the oldest exited child).
 * Without this, one such child - an exec's final process whose report is still coming,
 * or one a sandbox process made with clone(CLONE_PARENT), which makes it ours - held up
 * the reaping of every later child (other sandboxes' inits, background commands) for as
 * long as some intermediate was pending (rt-kernel review). O(children we know); a
 * waitpid of one pid is O(1) in the kernel. */
static void reap_known(void) {
    for (size_t k = 0; k < nreapable;) {
        int st = 0;
        if (waitpid(reapable[k].pid, &st, WNOHANG) == reapable[k].pid) {
            struct reap r = reapable[k];
            memmove(reapable + k, reapable + k + 1, (nreapable - k - 1) * sizeof *reapable);
            nreapable--;
            if (r.id) send_reply(REP_EXITED, r.id, r.pid, 0, st, 0, NULL, -1);
            continue;
        }
        k++;
    }
    for (size_t k = 0; k < njobs; k++) {
        struct job *j = &jobs[k];
        if (j->kind == J_FREE) continue;
        if (j->mid) on_mid_exit(j);
        if (j->kind == J_FG && j->pid && !j->final_done) on_final_exit(j);
    }
}

/* Reap whatever has exited among our children: inits and background commands (nobody
 * waits for their status), and our jobs' processes if their pidfd event has not come
 * yet. A child we know nothing about is a final process whose intermediate has not
 * reported yet - unless no intermediate is pending, then it is an orphan (its
 * intermediate was killed between fork and report) and is reaped. Peeking with WNOWAIT
 * never reaps a pid we might still be told about, so a reported pid is always ours. */
static void sweep(void) {
    drain_reports();
    sweep_deferred = 0;
    for (;;) {
        siginfo_t si;
        memset(&si, 0, sizeof si);
        if (waitid(P_ALL, 0, &si, WEXITED | WNOHANG | WNOWAIT) < 0 || si.si_pid == 0) return;
        pid_t p = si.si_pid;
        uint64_t rid = 0;
        if (reapable_take(p, &rid)) {
            int st = 0;
            waitpid(p, &st, WNOHANG);
            if (rid) send_reply(REP_EXITED, rid, p, 0, st, 0, NULL, -1);  /* an init died */
            continue;
        }
        struct job *j = job_of_pid(p);
        if (j && j->mid == p) { on_mid_exit(j); continue; }
        if (j && j->kind == J_FG) { on_final_exit(j); continue; }
        if (pending_mids == 0) {
            waitpid(p, NULL, WNOHANG);
            continue;
        }
        sweep_deferred = 1;  /* its report is on the way: retry when it (or a death) comes */
        reap_known();
        return;
    }
}

static char *req_argv[1 << 16];

/* fork an intermediate: `dups[i]` becomes its fd i, everything else >= n is closed and
 * the signal mask we run with is cleared. */
static pid_t fork_mid(struct job *j, const int *dups, int n) {
    my_slot = (uint32_t)(j - jobs);
    my_gen = j->gen;
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
    if (pid < 0) return -1;
    j->mid = pid;
    pending_mids++;
    j->pend = 1;
    j->mid_fd = (int)syscall(SYS_pidfd_open, pid, 0);
    if (j->mid_fd >= 0) {
        fcntl(j->mid_fd, F_SETFD, FD_CLOEXEC);
        watch(j->mid_fd, tag(j, W_MID));
    }  /* else sweep() finds its exit */
    return pid;
}

/* An exec for a sandbox with a helper: hand the command to the helper (with the stdio
 * pipes and the exec cgroup's procs files, opened here as the host's root) instead of
 * forking an intermediate. argv: exec HELPER_ID cwd user ncg cg... pids_index home
 * nenv env... -- target... Any refusal is Failed; the edge then takes the per-exec path. */
static void forward_exec(const struct req_hdr *h, int argc, int *fds, int nfds) {
    static char out[1 << 17];
    char err[128];
    int e = EINVAL;
    const char *why = "malformed helper exec";
    int cgfds[32] = {0}, ncgfd = 0;
    int sp[2] = {-1, -1};   /* F_TRACK: the status pipe (read end: ours once sent) */
    if (nfds != 4 || argc < 11 || strcmp(req_argv[1], "exec")) goto fail;
    uint64_t hid = strtoull(req_argv[2], NULL, 10);
    struct job *hj = NULL;
    for (size_t k = 0; k < njobs; k++)
        if (jobs[k].kind == J_HELPER && jobs[k].id == hid && jobs[k].mid) hj = &jobs[k];
    if (!hj) { e = ESRCH; why = "the exec helper is gone"; goto fail; }
    int i = 3;
    const char *cwd = req_argv[i++], *user = req_argv[i++];
    int ncg = atoi(req_argv[i++]);
    if (ncg < 0 || ncg > 32 || i + ncg + 3 > argc) goto fail;
    char **cgs = &req_argv[i];
    i += ncg + 2;  /* pids_index, home_procs: the per-exec path's task-limit fallback */
    int rest = argc - i;  /* nenv env... -- target... */
    /* The helper is in the sandbox's cgroups already and its children inherit them: the
     * command joins only the exec's own (the first: its freezer on v1, its v2 cgroup). */
    if (ncg > 1) ncg = 1;
    int track = (h->flags & F_TRACK) != 0;
    uint32_t fl = (track ? FWD_TRACK : 0u);
    if (h->flags & F_PTY)
        fl |= FWD_PTY | ((h->flags >> 12) & 1023u) << 4 | ((h->flags >> 22) & 1023u) << 14;
    struct fwd_hdr fh = {0, 0, (uint32_t)ncg, (uint32_t)(rest + 2), fl};
    size_t len = sizeof fh;
    const char *parts[2] = {cwd, user};
    for (int k = 0; k < 2 + rest; k++) {
        const char *str = k < 2 ? parts[k] : req_argv[i + k - 2];
        size_t l = strlen(str) + 1;
        if (len + l > sizeof out - 1) { e = E2BIG; why = "too big for the exec helper"; goto fail; }
        memcpy(out + len, str, l);
        len += l;
    }
    for (; ncgfd < ncg; ncgfd++) {
        cgfds[ncgfd] = open(cgs[ncgfd], O_WRONLY | O_CLOEXEC);
        if (cgfds[ncgfd] < 0) { e = errno; why = "open the exec's cgroup"; goto fail; }
    }
    size_t hk = (size_t)(hj - jobs);
    struct job *j = new_job();  /* may move the table */
    if (!j) { e = ENOMEM; why = "no memory"; goto fail; }
    hj = &jobs[hk];
    if (track && status_pipe(sp) < 0) { e = errno; why = "pipe2"; goto fail; }
    fh.slot = (uint32_t)(j - jobs);
    fh.gen = j->gen;
    memcpy(out, &fh, sizeof fh);
    int npass = 3 + ncg + track;
    int pass[36] = {fds[1], fds[2], fds[3]};
    for (int k = 0; k < ncg; k++) pass[3 + k] = cgfds[k];
    if (track) pass[3 + ncg] = sp[1];
    struct iovec iov = {out, len};
    union { char b[CMSG_SPACE(36 * sizeof(int))]; struct cmsghdr align; } u;
    struct msghdr m = {0};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = u.b;
    m.msg_controllen = CMSG_SPACE((size_t)npass * sizeof(int));
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN((size_t)npass * sizeof(int));
    memcpy(CMSG_DATA(c), pass, (size_t)npass * sizeof(int));
    ssize_t r;
    while ((r = sendmsg(hj->hsock, &m, MSG_DONTWAIT | MSG_NOSIGNAL)) < 0 && errno == EINTR) {}
    if (r < 0) { e = errno; why = "send to the exec helper"; goto fail; }
    j->kind = J_FG;
    j->id = h->id;
    j->mid_fd = j->pid_fd = j->status_fd = -1;
    if (track) {   /* Running once the command's execve closed it; Failed with its reason */
        close(sp[1]);
        sp[1] = -1;
        j->track = 1;
        j->status_fd = sp[0];
        sp[0] = -1;
    }
    j->via = (uint32_t)(hj - jobs) + 1;
    j->via_gen = hj->gen;
    j->pend = 1;
    pending_mids++;
    if (j->status_fd >= 0) watch(j->status_fd, tag(j, W_STATUS));
    for (int k = 0; k < ncgfd; k++) close(cgfds[k]);
    send_reply(REP_STARTED, h->id, 0, 0, 0, 0, NULL, -1);
    return;
fail:
    for (int k = 0; k < 2; k++) if (sp[k] >= 0) close(sp[k]);
    for (int k = 0; k < ncgfd; k++) close(cgfds[k]);
    snprintf(err, sizeof err, "%s", why);
    send_reply(REP_FAILED, h->id, 0, 0, 0, e, err, -1);
}

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
        off = (size_t)(z - data) + 1;
    }
    req_argv[argc] = NULL;
    int bpf = bpf_fds[(h.flags & F_NESTED) ? 1 : 0];
    userns_req = (h.flags & F_USERNS) != 0;
    netns_req = (h.flags & F_NETNS) != 0;
    sysfs_req = (h.flags & F_SYSFS) != 0;
    scratch_req = (h.flags & F_SCRATCH) != 0;
    ipccaps_req = (h.flags & F_IPCCAPS) != 0;
    lazypts_req = (h.flags & F_LAZYPTS) != 0;
    pty_req = (h.flags & F_PTY) != 0;
    pty_cols = (unsigned short)((h.flags >> 12) & 1023);
    pty_rows = (unsigned short)((h.flags >> 22) & 1023);
    if (h.type == REQ_KILL) {
        /* The exec's intermediate and command, by pidfd (the edge kills the rest of a
         * foreground exec's cgroup); a command reported later is killed on arrival. A
         * background exec is killed only before it was reported started (the edge gave
         * up waiting for it); then it answers Failed. */
        for (size_t k = 0; k < njobs; k++)
            if ((jobs[k].kind == J_FG || jobs[k].kind == J_BG) && jobs[k].id == h.id
                    && !jobs[k].replied) {
                struct job *j = &jobs[k];
                j->killed = 1;
                if (j->mid_fd >= 0) pidfd_signal(j->mid_fd, SIGKILL);
                else if (j->mid) kill(j->mid, SIGKILL);
                if (j->pid && !j->final_done) {
                    if (j->pid_fd >= 0) pidfd_signal(j->pid_fd, SIGKILL);
                    else kill(j->pid, SIGKILL);  /* unreaped child: exact */
                }
            }
        goto out;
    }
    if (h.type == REQ_HELPER) {
        if (nfds != 1 || argc < 3 || strcmp(req_argv[1], "helper")) {
            snprintf(err, sizeof err, "helper needs 1 fd and a helper argv, got %d fds", nfds);
            send_reply(REP_FAILED, h.id, 0, 0, 0, EINVAL, err, -1);
            goto out;
        }
        int sp[2];
        if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp) < 0) goto sys;
        struct job *j = new_job();
        if (!j) { close(sp[0]); close(sp[1]); errno = ENOMEM; goto sys; }
        j->kind = J_HELPER;
        j->id = h.id;
        j->mid_fd = j->pid_fd = j->status_fd = -1;
        j->hsock = sp[0];
        int dups[7] = {devnull, devnull, devnull, fds[0], bpf_fds[0], sp[1], rep_fds[1]};
        pid_t pid = fork_mid(j, dups, 7);
        if (pid == 0) {
            /* a fresh image: forking the helper per exec then copies a few pages, not
             * the zygote's buffers */
            req_argv[0] = "dsec-nsexec";
            execv("/proc/self/exe", req_argv);
            _exit(126);
        }
        close(sp[1]);
        if (pid < 0) { close(sp[0]); j->kind = J_FREE; goto sys; }
        j->pend = 0;      /* a helper reports no command of its own */
        pending_mids--;
        send_reply(REP_STARTED, h.id, pid, 0, 0, 0, NULL, -1);
        goto out;
    }
    if (h.type == REQ_EXEC && (h.flags & F_HELPER)) {
        forward_exec(&h, argc, fds, nfds);
        goto out;
    }
    if (h.type == REQ_EXEC) {
        if (nfds != 4 || argc < 2 || strcmp(req_argv[1], "exec")) {
            snprintf(err, sizeof err, "exec needs 4 fds and an exec argv, got %d fds", nfds);
            send_reply(REP_FAILED, h.id, 0, 0, 0, EINVAL, err, -1);
            goto out;
        }
        int bg = h.flags & F_BACKGROUND;
        int track = !bg && (h.flags & F_TRACK);
        int sp[2] = {-1, -1};
        if ((bg || track) && status_pipe(sp) < 0) goto sys;
        int dups[7] = {bg ? devnull : fds[1], bg ? devnull : fds[2], bg ? devnull : fds[3],
                       fds[0], bpf, (bg || track) ? sp[1] : devnull, rep_fds[1]};
        struct job *j = new_job();
        if (!j) { errno = ENOMEM; goto sys_pipe; }
        j->kind = bg ? J_BG : J_FG;
        j->id = h.id;
        j->mid_fd = j->pid_fd = j->status_fd = -1;
        pid_t pid = fork_mid(j, dups, 7);
        if (pid == 0) { do_exec(argc, req_argv); _exit(126); }
        if (pid < 0) { j->kind = J_FREE; goto sys_pipe; }
        if (!bg) {
            send_reply(REP_STARTED, h.id, pid, 0, 0, 0, NULL, -1);
            if (track) {
                close(sp[1]);
                j->track = 1;
                j->status_fd = sp[0];
                watch(sp[0], tag(j, W_STATUS));
            }
        } else {
            close(sp[1]);
            j->status_fd = sp[0];
            watch(sp[0], tag(j, W_STATUS));
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
        if (argc < 2 || strcmp(req_argv[1], "create")) goto bad;
        if (nfds != (netns_req ? 1 : 0)) {
            snprintf(err, sizeof err, "create needs %d fds (the slot netns with F_NETNS), got %d",
                     netns_req ? 1 : 0, nfds);
            send_reply(REP_FAILED, h.id, 0, 0, 0, EINVAL, err, -1);
            goto out;
        }
        int sp[2];
        if (status_pipe(sp) < 0) goto sys;
        struct job *j = new_job();
        int dups[7] = {devnull, devnull, devnull, sp[1], bpf, netns_req ? fds[0] : devnull,
                       rep_fds[1]};
        if (j) {
            j->kind = J_CREATE;
            j->id = h.id;
            j->mid_fd = j->pid_fd = j->status_fd = -1;
        }
        pid_t pid = j ? fork_mid(j, dups, 7) : -1;
        if (pid == 0) { do_create(argc, req_argv); _exit(1); }
        close(sp[1]);
        if (pid < 0) {
            if (j) j->kind = J_FREE;
            close(sp[0]);
            goto sys;
        }
        j->status_fd = sp[0];
        watch(sp[0], tag(j, W_STATUS));
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
     * of fork_mid() (targets 0..6) never overwrite a source they still need. */
    sock = high_fd(atoi(argv[2]));
    bpf_fds[0] = high_fd(atoi(argv[3]));
    bpf_fds[1] = high_fd(atoi(argv[4]));
    init_bin = argv[5];
    for (;;) {
        int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
        if (fd < 0 || fd >= 10) { if (fd >= 0) close(fd); break; }
    }
    devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, rep_fds) < 0) {
        perror("dsec-nsexec serve: socketpair");
        return 2;
    }
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigprocmask(SIG_BLOCK, &chld, NULL);
    sigfd = signalfd(-1, &chld, SFD_NONBLOCK | SFD_CLOEXEC);
    epfd = epoll_create1(EPOLL_CLOEXEC);
    if (devnull < 0 || sigfd < 0 || epfd < 0) { perror("dsec-nsexec serve"); return 2; }
    watch(sock, ((uint64_t)T_SOCK << 2) | W_FIXED);
    watch(sigfd, ((uint64_t)T_SIG << 2) | W_FIXED);
    watch(rep_fds[0], ((uint64_t)T_REPORT << 2) | W_FIXED);
    static char buf[4 << 20];
    union { char b[CMSG_SPACE(8 * sizeof(int))]; struct cmsghdr align; } u;
    for (;;) {
        struct epoll_event evs[64];
        int n = epoll_wait(epfd, evs, 64, -1);
        if (n < 0 && errno != EINTR) return 2;
        int need_sweep = 0;
        for (int e = 0; e < n; e++) {
            uint64_t t = evs[e].data.u64;
            int what = (int)(t & 3);
            size_t slot = (size_t)((t >> 2) & 0x3fffffff);
            if (what != W_FIXED) {
                if (slot >= njobs) continue;
                struct job *j = &jobs[slot];
                if (j->kind == J_FREE || j->gen != (uint32_t)(t >> 32)) continue;  /* stale */
                if (what == W_STATUS && j->status_fd >= 0) on_status(j);
                else if (what == W_MID) on_mid_exit(j);
                else if (what == W_FINAL) on_final_exit(j);
                continue;
            }
            if (slot == T_SIG) {
                struct signalfd_siginfo si;
                while (read(sigfd, &si, sizeof si) > 0) {}
                need_sweep = 1;
                continue;
            }
            if (slot == T_REPORT) { drain_reports(); continue; }
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
        if (need_sweep || sweep_deferred == 2) sweep();
    }
}

/* dsec-nsexec filter BPF_FILE PROG [ARGS...]: no_new_privs, the seccomp program in
 * BPF_FILE, then execvp PROG (the gvisor tier, runsc.py). runsc exec starts a process
 * without the container's OCI seccomp filter - only its init has it - so every exec
 * there goes through this, inside the Sentry, and gets the same deny list as a native
 * sandbox's processes. A program that cannot be run: 127 (not found) or 126, with
 * "dsec: cannot run" on stderr, as the native exec path reports it. */
static int do_filter(int argc, char **argv) {
    static struct sock_filter prog[BPF_MAXINSNS];
    if (argc < 4) {
        fprintf(stderr, "usage: dsec-nsexec filter BPF PROG [ARGS...]\n");
        return 2;
    }
    exec_mode = 1;
    exec_what = argv[3];
    int fd = open(argv[2], O_RDONLY | O_CLOEXEC | O_NOCTTY);
    if (fd < 0) die(126, "open %s", argv[2]);
    ssize_t n = read(fd, prog, sizeof prog);
    close(fd);
    if (n <= 0 || n % (ssize_t)sizeof(struct sock_filter)) {
        errno = EINVAL;
        die(126, "seccomp program of %zd bytes", n);
    }
    default_signals();
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) die(126, "prctl(PR_SET_NO_NEW_PRIVS)");
    struct sock_fprog fprog = {(unsigned short)(n / sizeof(struct sock_filter)), prog};
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &fprog, 0, 0) < 0)
        die(126, "prctl(PR_SET_SECCOMP)");
    execvp(argv[3], argv + 3);
    die(errno == ENOENT ? 127 : 126, "execve");
    return 126;
}

int main(int argc, char **argv) {
    /* Non-dumpable, inherited by every fork until its final execve: a sandbox process
     * cannot open /proc/<child>/root, cwd or fd/N while the child still holds host state
     * (the command's process is visible inside from its birth). */
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    /* The name every exec's final process shows inside until its execve (/proc/<pid>/comm;
     * the file's name carries a build hash). */
    prctl(PR_SET_NAME, "dsec-nsexec", 0, 0, 0);
    if (argc >= 2 && strcmp(argv[1], "serve") == 0) return do_serve(argc, argv);
    if (argc >= 2 && strcmp(argv[1], "helper") == 0) return do_helper(argc, argv);
    if (argc >= 2 && strcmp(argv[1], "filter") == 0) return do_filter(argc, argv);
    fprintf(stderr, "usage: dsec-nsexec serve SOCK BPF BPF_NESTED INIT (started by the dsec edge)\n");
    return 2;
}
