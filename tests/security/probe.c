/* dsec security probe: one hostile action per invocation, run inside a sandbox by
 * tests/security. Prints "<probe>=ok" when the kernel let the action through and
 * "<probe>=E<errno>" when it was refused (a seccomp/ABI kill shows as exit status 159).
 * Compiled statically at test time (gcc -static) and stacked into the sandbox as a
 * toolkit layer, so the busybox image needs no compiler. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <unistd.h>
#include <time.h>
#include <sys/mount.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <linux/vm_sockets.h>

static int res(const char *name, long r) {
    if (r < 0) printf("%s=E%d\n", name, errno); else printf("%s=ok\n", name);
    return 0;
}
static long fork_ns(unsigned long flags) {
    long r = syscall(SYS_clone, flags | SIGCHLD, 0, 0, 0, 0);
    if (r == 0) _exit(0);
    if (r > 0) waitpid(r, 0, 0);
    return r;
}
struct clone_args_ { uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls, set_tid, set_tid_size, cgroup; };
static long clone3_ns(unsigned long flags) {
    struct clone_args_ a; memset(&a, 0, sizeof a); a.flags = flags; a.exit_signal = SIGCHLD;
    long r = syscall(435, &a, sizeof a);
    if (r == 0) _exit(0);
    if (r > 0) waitpid(r, 0, 0);
    return r;
}
int main(int argc, char **argv) {
    const char *p = argc > 1 ? argv[1] : "";
    const char *arg = argc > 2 ? argv[2] : "";
    if (!strcmp(p, "clone3_userns")) return res(p, clone3_ns(CLONE_NEWUSER));
    if (!strcmp(p, "clone3_plain")) return res(p, clone3_ns(0));
    if (!strcmp(p, "clone_userns")) return res(p, fork_ns(CLONE_NEWUSER));
    if (!strcmp(p, "clone_newns")) return res(p, fork_ns(CLONE_NEWNS));
    if (!strcmp(p, "clone_newnet")) return res(p, fork_ns(CLONE_NEWNET));
    if (!strcmp(p, "unshare_user")) return res(p, unshare(CLONE_NEWUSER));
    if (!strcmp(p, "unshare_mnt")) return res(p, unshare(CLONE_NEWNS));
    if (!strcmp(p, "setns_mnt")) { int fd = open("/proc/1/ns/mnt", O_RDONLY); if (fd < 0) return res(p, -1); return res(p, setns(fd, 0)); }
    if (!strcmp(p, "mount_proc")) { mkdir("/tmp/.p", 0755); return res(p, mount("proc", "/tmp/.p", "proc", 0, 0)); }
    if (!strcmp(p, "mount_cgroup")) { mkdir("/tmp/.c", 0755); return res(p, mount("cgroup", "/tmp/.c", "cgroup", 0, "pids")); }
    if (!strcmp(p, "fsopen")) return res(p, syscall(430, "tmpfs", 0));
    if (!strcmp(p, "open_tree")) return res(p, syscall(428, AT_FDCWD, "/", 1 /*OPEN_TREE_CLONE*/));
    if (!strcmp(p, "keyctl")) return res(p, syscall(SYS_keyctl, 0 /*GET_KEYRING_ID*/, -4 /*USER*/, 0));
    if (!strcmp(p, "add_key")) return res(p, syscall(SYS_add_key, "user", "dsec-probe", "x", 1, -2 /*PROCESS*/));
    if (!strcmp(p, "userfaultfd")) return res(p, syscall(323, 0));
    if (!strcmp(p, "bpf")) { char attr[128]; memset(attr, 0, sizeof attr); return res(p, syscall(321, 0, attr, sizeof attr)); }
    if (!strcmp(p, "perf_event_open")) { char attr[128]; memset(attr, 0, sizeof attr); *(uint32_t*)(attr+4) = 128; return res(p, syscall(298, attr, 0, -1, -1, 0)); }
    if (!strcmp(p, "ptrace_traceme")) return res(p, ptrace(PTRACE_TRACEME, 0, 0, 0));
    if (!strcmp(p, "init_module")) return res(p, syscall(175, "", 0, ""));
    if (!strcmp(p, "finit_module")) { int fd = open("/bin/busybox", O_RDONLY); return res(p, syscall(313, fd, "", 0)); }
    if (!strcmp(p, "open_by_handle_at")) { char h[64]; memset(h, 0, sizeof h); *(unsigned*)h = 8; return res(p, syscall(304, AT_FDCWD, h, 0)); }
    if (!strcmp(p, "mknod_mem")) return res(p, mknod("/tmp/.mem", S_IFCHR | 0600, makedev(1, 1)));
    if (!strcmp(p, "io_uring_setup")) { char prm[120]; memset(prm, 0, sizeof prm); return res(p, syscall(425, 4, prm)); }
    if (!strcmp(p, "x32_getpid")) return res(p, syscall(0x40000000 | 39));
    if (!strcmp(p, "x32_unshare")) return res(p, syscall(0x40000000 | 272, CLONE_NEWUSER));
    if (!strcmp(p, "int80_getpid")) { long r; __asm__ volatile("int $0x80" : "=a"(r) : "a"(20) : "memory"); printf("%s=ok(%ld)\n", p, r); return 0; }
    if (!strcmp(p, "kmsg")) return res(p, open("/proc/kmsg", O_RDONLY | O_NONBLOCK));
    if (!strcmp(p, "sysrq")) return res(p, open("/proc/sysrq-trigger", O_WRONLY));
    if (!strcmp(p, "proc_sys_write")) return res(p, open("/proc/sys/kernel/core_pattern", O_WRONLY));
    if (!strcmp(p, "sys_write")) return res(p, open("/sys/kernel/mm/transparent_hugepage/enabled", O_WRONLY));
    if (!strcmp(p, "sethostname")) return res(p, sethostname("evil", 4));
    if (!strcmp(p, "settime")) { struct timespec ts = {1, 0}; return res(p, clock_settime(CLOCK_REALTIME, &ts)); }
    if (!strcmp(p, "chroot_escape")) {
        mkdir("/tmp/.cx", 0755);
        if (chroot("/tmp/.cx") < 0) return res(p, -1);
        for (int i = 0; i < 64; i++) chdir("..");
        chroot(".");
        struct stat st; return res(p, stat(arg, &st));
    }
    if (!strcmp(p, "stat")) { struct stat st; return res(p, stat(arg, &st)); }
    if (!strcmp(p, "vsock_bind")) {
        int s = socket(40, SOCK_STREAM, 0); if (s < 0) return res(p, -1);
        struct sockaddr_vm a; memset(&a, 0, sizeof a); a.svm_family = 40; a.svm_cid = VMADDR_CID_ANY; a.svm_port = atoi(arg);
        return res(p, bind(s, (struct sockaddr*)&a, sizeof a));
    }
    if (!strcmp(p, "fds")) {
        DIR *d = opendir("/proc/self/fd"); struct dirent *e; char l[512], path[300]; int me = dirfd(d);
        while ((e = readdir(d))) { int n = atoi(e->d_name); if (e->d_name[0] == '.' || n == me) continue;
            snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name); ssize_t k = readlink(path, l, sizeof l - 1); l[k > 0 ? k : 0] = 0;
            printf("fd %d -> %s\n", n, l); }
        return 0;
    }
    if (!strcmp(p, "euid")) { printf("euid=%d\n", geteuid()); return 0; }
    if (!strcmp(p, "procroot_loop")) {
        /* Hammer /proc/<pid>/{root,cwd,exe,fd} of every other process for argv[3] seconds,
           report any access that reaches the host marker or any foreign fd. */
        int secs = argc > 3 ? atoi(argv[3]) : 2; time_t end = time(0) + secs; int hits = 0, tries = 0;
        pid_t me = getpid();
        while (time(0) < end) {
            DIR *d = opendir("/proc"); struct dirent *e;
            while ((e = readdir(d))) {
                int pid = atoi(e->d_name); if (pid <= 0 || pid == me) continue;
                char path[600]; struct stat st;
                snprintf(path, sizeof path, "/proc/%d/root%s", pid, arg); tries++;
                if (stat(path, &st) == 0) { printf("HIT root %s\n", path); hits++; }
                snprintf(path, sizeof path, "/proc/%d/cwd%s", pid, arg);
                if (stat(path, &st) == 0) { printf("HIT cwd %s\n", path); hits++; }
                for (int fd = 3; fd < 12; fd++) { snprintf(path, sizeof path, "/proc/%d/fd/%d", pid, fd);
                    char l[300]; ssize_t k = readlink(path, l, sizeof l - 1);
                    if (k > 0) { l[k] = 0; if (strstr(l, "socket:") || strstr(l, "dsec") || strstr(l, "python")) { printf("HIT fd %s -> %s\n", path, l); hits++; } } }
            }
            closedir(d);
        }
        printf("procroot_loop tries=%d hits=%d\n", tries, hits);
        return 0;
    }

    if (!strcmp(p, "nsview_loop")) {
        /* Until the file argv[2] exists (at most argv[3] seconds): read mountinfo, net/tcp,
           net/unix and net/tcp6 of every other process and compare them with our own (every
           process of the sandbox shares our mount and network namespace, so each must be
           byte-identical). A different table is a process seen while still half outside:
           print what it showed. */
        static const char *const files[] = {"mountinfo", "net/tcp", "net/unix", "net/tcp6"};
        static char own[4][1 << 16], buf[1 << 16];
        ssize_t ownlen[4];
        for (int k = 0; k < 4; k++) {
            char path[64]; snprintf(path, sizeof path, "/proc/self/%s", files[k]);
            int fd = open(path, O_RDONLY); ownlen[k] = fd < 0 ? -1 : read(fd, own[k], sizeof own[k]);
            if (fd >= 0) close(fd);
        }
        int secs = argc > 3 ? atoi(argv[3]) : 60; time_t end = time(0) + secs;
        long reads = 0, hits = 0, scans = 0; pid_t me = getpid(); struct stat st;
        while (time(0) < end && stat(arg, &st) != 0) {
            DIR *d = opendir("/proc"); struct dirent *e; scans++;
            while ((e = readdir(d))) {
                int pid = atoi(e->d_name); if (pid <= 1 || pid == me) continue;
                for (int k = 0; k < 4; k++) {
                    char path[64]; snprintf(path, sizeof path, "/proc/%d/%s", pid, files[k]);
                    int fd = open(path, O_RDONLY); if (fd < 0) continue;
                    ssize_t n = read(fd, buf, sizeof buf); close(fd);
                    if (n <= 0) continue;
                    reads++;
                    if (n != ownlen[k] || memcmp(buf, own[k], (size_t)n)) {
                        hits++;
                        if (hits <= 5) { char *nl = memchr(buf, '\n', (size_t)n); int l = nl ? (int)(nl - buf) : (int)(n > 200 ? 200 : n);
                            printf("HIT pid %d %s (%zd bytes, ours %zd): %.*s\n", pid, files[k], n, ownlen[k], l > 200 ? 200 : l, buf); }
                    }
                }
            }
            closedir(d);
        }
        printf("nsview_loop scans=%ld reads=%ld hits=%ld\n", scans, reads, hits);
        return 0;
    }
    if (!strcmp(p, "nested_cgroupfs")) {
        /* allow_nested: build a user namespace (root = our host uid), a mount namespace and
           a cgroup namespace, mount the cgroup hierarchy argv[2] (v1 controller or
           "unified") and write argv[4] into its file argv[3] - the sandbox's own cgroup,
           the root of that view. "ok" = the write went through (a limit escaped). How:
           argv[5] = "unshare" (default), "clone" or "clone3". */
        const char *how = argc > 5 ? argv[5] : "unshare";
        unsigned long fl = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWCGROUP;
        if (!strcmp(how, "clone") || !strcmp(how, "clone3")) {
            long c = !strcmp(how, "clone") ? syscall(SYS_clone, fl | SIGCHLD, 0, 0, 0, 0) : 0;
            if (!strcmp(how, "clone3")) {
                struct clone_args_ a; memset(&a, 0, sizeof a); a.flags = fl; a.exit_signal = SIGCHLD;
                c = syscall(435, &a, sizeof a);
            }
            if (c < 0) return res(p, -1);
            if (c > 0) { int st; waitpid(c, &st, 0); return 0; }  /* the child prints */
        } else if (unshare(fl) < 0) {
            return res(p, -1);
        }
        int fd = open("/proc/self/setgroups", O_WRONLY); if (fd >= 0) { write(fd, "deny", 4); close(fd); }
        fd = open("/proc/self/uid_map", O_WRONLY); if (fd >= 0) { write(fd, "0 0 1", 5); close(fd); }
        fd = open("/proc/self/gid_map", O_WRONLY); if (fd >= 0) { write(fd, "0 0 1", 5); close(fd); }
        mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL);
        mkdir("/tmp/.ncg", 0755);
        long r = !strcmp(arg, "unified") ? mount("cgroup2", "/tmp/.ncg", "cgroup2", 0, NULL)
                                         : mount("cgroup", "/tmp/.ncg", "cgroup", 0, arg);
        if (r < 0) { res(p, -1); fflush(stdout); if (strcmp(how, "unshare")) _exit(0); return 0; }
        char path[300]; snprintf(path, sizeof path, "/tmp/.ncg/%s", argc > 3 ? argv[3] : "pids.max");
        const char *val = argc > 4 ? argv[4] : "max";
        fd = open(path, O_WRONLY);
        r = fd < 0 ? -1 : write(fd, val, strlen(val));
        if (fd >= 0) close(fd);
        res(p, r); fflush(stdout);
        if (strcmp(how, "unshare")) _exit(0);
        return 0;
    }
    if (!strcmp(p, "nested_userns_tmpfs")) {
        /* allow_nested's purpose still works: a user + mount namespace with a tmpfs in it */
        if (unshare(CLONE_NEWUSER | CLONE_NEWNS) < 0) return res(p, -1);
        int fd = open("/proc/self/uid_map", O_WRONLY); if (fd >= 0) { write(fd, "0 0 1", 5); close(fd); }
        mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL);
        mkdir("/tmp/.nt", 0755);
        return res(p, mount("tmpfs", "/tmp/.nt", "tmpfs", 0, "size=1m"));
    }
    if (!strcmp(p, "stop_newcomers")) {
        /* SIGSTOP every process born after us (the next pids of this pid namespace) until
           /tmp/stop exists or argv[2] seconds pass: a hostile process freezing whatever
           the edge starts in the sandbox before it can run its command. */
        int secs = atoi(arg); time_t end = time(0) + secs; long rounds = 0; struct stat st;
        pid_t me = getpid();
        while (time(0) < end && stat("/tmp/stop", &st) != 0) {
            for (pid_t q = me + 1; q < me + 64; q++) kill(q, SIGSTOP);
            rounds++;
        }
        printf("stop_newcomers rounds=%ld\n", rounds);
        return 0;
    }
    if (!strcmp(p, "clone_parent")) {
        /* argv[2] children made with clone(CLONE_PARENT): siblings of ours, so children
           of whoever started us; each exits at once */
        int n = atoi(arg), made = 0;
        for (int i = 0; i < n; i++) {
            long c = syscall(SYS_clone, CLONE_PARENT | SIGCHLD, 0, 0, 0, 0);
            if (c == 0) _exit(0);
            if (c > 0) made++;
        }
        printf("clone_parent=%d\n", made);
        return 0;
    }
    if (!strcmp(p, "cmdline_loop")) {
        /* Until the file argv[2] exists (at most argv[3] seconds): read /proc/<pid>/cmdline
           and comm of every other process and print each distinct text once ("cmdline: ..."),
           NULs as spaces - what a process inside learns about the processes the edge starts. */
        static char seen[200][300]; int nseen = 0; long reads = 0;
        int secs = argc > 3 ? atoi(argv[3]) : 60; time_t end = time(0) + secs;
        pid_t me = getpid(); struct stat st;
        while (time(0) < end && stat(arg, &st) != 0) {
            DIR *d = opendir("/proc"); struct dirent *e;
            while ((e = readdir(d))) {
                int pid = atoi(e->d_name); if (pid <= 1 || pid == me) continue;
                static const char *const files[] = {"cmdline", "comm"};
                for (int k = 0; k < 2; k++) {
                    char path[64], buf[290]; snprintf(path, sizeof path, "/proc/%d/%s", pid, files[k]);
                    int fd = open(path, O_RDONLY); if (fd < 0) continue;
                    ssize_t n = read(fd, buf, sizeof buf - 1); close(fd);
                    if (n <= 0) continue;
                    reads++;
                    for (ssize_t i = 0; i < n; i++) if (buf[i] == 0 || buf[i] == '\n') buf[i] = ' ';
                    buf[n] = 0;
                    char key[300]; snprintf(key, sizeof key, "%s: %s", files[k], buf);
                    int dup = 0; for (int i = 0; i < nseen && !dup; i++) dup = !strcmp(seen[i], key);
                    if (!dup && nseen < 200) strcpy(seen[nseen++], key);
                }
            }
            closedir(d);
        }
        for (int i = 0; i < nseen; i++) printf("%s\n", seen[i]);
        printf("cmdline_loop reads=%ld\n", reads);
        return 0;
    }
    if (!strcmp(p, "keyring_id")) {
        long id = syscall(SYS_keyctl, 0 /*GET_KEYRING_ID*/, -4 /*USER*/, 0);
        if (id < 0) return res(p, -1);
        printf("keyring_id=%ld\n", id); return 0;
    }
    if (!strcmp(p, "keyread")) {
        long id = syscall(SYS_keyctl, 10 /*KEYCTL_SEARCH*/, -4 /*USER*/, "user", arg, 0);
        if (id < 0) return res(p, -1);
        char buf[256]; long n = syscall(SYS_keyctl, 11 /*KEYCTL_READ*/, id, buf, sizeof buf - 1);
        if (n < 0) return res(p, -1);
        buf[n < 255 ? n : 255] = 0; printf("keyread=ok payload=%s\n", buf); return 0;
    }
    printf("unknown probe %s\n", p);
    return 2;
}
