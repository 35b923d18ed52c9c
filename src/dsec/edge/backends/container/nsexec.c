/* dsec-nsexec: the per-process half of the native container driver.
 *
 * The zygote (zygote.py) posix_spawn()s this small static binary - vfork semantics, so the
 * ~20 MB Python helper's page tables are never copied - with its pid namespace for
 * children already pointing into the sandbox (exec) or at a fresh pid namespace (create).
 * Everything after that runs here, in C, with no Python, no dynamic loader and no
 * imports: measured on the 2-core dev VM, a Python fork + ctypes capset/prctl/seccomp
 * child cost ~1.5-2 ms of CPU per exec; this binary's whole setup is a few dozen syscalls.
 *
 *   dsec-nsexec exec   <cwd|""> <user|""> <ncg> <cgroup.procs>... <nenv> <K=V>... -- argv...
 *       fds: 0-2 stdio, 3 init pidfd, 4 seccomp BPF (memfd), 5 status pipe or /dev/null
 *   dsec-nsexec create <root> <overlay options> <hostname> <loopback 0|1> <tmp bytes>
 *                      <init binary> <ncg> <cgroup.procs>...
 *       fds: 3 status pipe, 4 seccomp BPF (memfd); this process is PID 1 of a new pid ns.
 *
 * Errors: exec writes "dsec: cannot run ..." to stderr and exits 127 (not found) or 126;
 * create writes the reason to the status pipe and exits 1. On success the status pipe
 * (close-on-exec) reads EOF. The sandbox layout tables (devices, masked and read-only
 * paths, capabilities) are generated from rootfs.py / linux.py into dsec_tables.h.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <net/if.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
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

static void build_root(const char *overlay_opts, const char *init_path, long long tmp_bytes) {
    char p[8192], q[8192], opts[256];
    xmount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL);
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
    for (size_t k = 0; k < sizeof DSEC_MASKED_DIRS / sizeof DSEC_MASKED_DIRS[0]; k++) {
        snprintf(p, sizeof p, "%s", at_root(DSEC_MASKED_DIRS[k]));
        if (is_dir(p))
            xmount("tmpfs", p, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                   "size=0,nr_inodes=1");
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
    /* argv: create root overlay_opts hostname loopback tmp_bytes init ncg cg... */
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
    join_cgroups(ncg, &argv[9]);
    if (unshare(NS_ENTER) < 0) die(1, "unshare(0x%x)", NS_ENTER);
    umask(0);
    build_root(overlay_opts, init_path, tmp_bytes);
    umask(022);
    if (sethostname(hostname, strnlen(hostname, 64)) < 0) die(1, "sethostname");
    if (loopback) loopback_up();
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

int main(int argc, char **argv) {
    /* Non-dumpable until the final execve: a sandbox process cannot open
     * /proc/<us>/root, cwd or fd/N while we still hold host state. */
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    if (argc >= 2 && strcmp(argv[1], "exec") == 0) return do_exec(argc, argv);
    if (argc >= 2 && strcmp(argv[1], "create") == 0) return do_create(argc, argv);
    fprintf(stderr, "usage: dsec-nsexec exec|create ... (started by the dsec zygote)\n");
    return 2;
}
