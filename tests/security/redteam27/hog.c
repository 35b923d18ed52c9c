/* Red team 27 helper: pin memory in things no OOM kill frees.
 *   hog shm MIB [MIB..]  SysV shm segments (not removed), touched, then exit
 *   hog msg MIB          fill message queues until MIB or refused, then exit
 *   hog nsshm MIB        unshare(user+ipc), shm segment MIB in it, then pause (holder)
 *   hog nstmp MIB        unshare(user+mnt), tmpfs MIB of files, then pause (holder)
 *   hog anon MIB         a detached process holding MIB of touched anonymous memory
 *   hog files DIR N      N empty files with long names in DIR (no tmpfs blocks used)
 *   hog mq N             open N POSIX message queues (10 x 8 KiB each), left in place
 *   hog sem N            N SysV semaphore arrays of 32,000 semaphores (left in place)
 *   hog inotify N        up to N inotify instances, held by a detached process
 *   hog msg0 Q           Q message queues, each filled with 0-byte messages until refused
 *   hog sysctl           print shmmax shmall msgmni msgmnb of this ipc ns
 * Prints what it got on stdout. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ipc.h>
#include <sys/mount.h>
#include <mqueue.h>
#include <sys/msg.h>
#include <sys/shm.h>
#include <sys/sem.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

static void cat(const char *p) {
    char b[64] = {0};
    int fd = open(p, O_RDONLY);
    if (fd < 0) { printf("%s ?\n", p); return; }
    ssize_t n = read(fd, b, sizeof b - 1);
    if (n > 0) b[n] = 0;
    close(fd);
    printf("%s %s", p, b);
}

static long shm(long mib) {
    size_t sz = (size_t)mib << 20;
    int id = shmget(IPC_PRIVATE, sz, IPC_CREAT | 0600);
    if (id < 0) { printf("shmget %ld MiB: %s\n", mib, strerror(errno)); return 0; }
    char *p = shmat(id, NULL, 0);
    if (p == (void *)-1) { printf("shmat: %s\n", strerror(errno)); return 0; }
    for (size_t i = 0; i < sz; i += 4096) p[i] = 1;
    shmdt(p);
    printf("shm %ld MiB id %d\n", mib, id);
    fflush(stdout);
    return mib;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IONBF, 0);
    if (argc < 2) return 2;
    if (!strcmp(argv[1], "sysctl")) {
        cat("/proc/sys/kernel/shmmax"); cat("/proc/sys/kernel/shmall");
        cat("/proc/sys/kernel/msgmni"); cat("/proc/sys/kernel/msgmnb");
        cat("/proc/sys/kernel/sem");
        return 0;
    }
    if (!strcmp(argv[1], "files")) {
        long n = atol(argv[3]), made = 0;
        char name[300];
        int d = open(argv[2], O_PATH | O_DIRECTORY);
        if (d < 0) { printf("open %s: %s\n", argv[2], strerror(errno)); return 1; }
        for (; made < n; made++) {
            snprintf(name, sizeof name, "%0200ld", made);
            int f = openat(d, name, O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
            if (f < 0) { printf("file %ld: %s\n", made, strerror(errno)); break; }
            close(f);
        }
        printf("files %ld\n", made);
        return 0;
    }
    if (!strcmp(argv[1], "mq")) {
        long n = atol(argv[2]), made = 0;
        struct mq_attr at = {.mq_maxmsg = 10, .mq_msgsize = 8192};
        char name[64];
        for (; made < n; made++) {
            snprintf(name, sizeof name, "/rt27-%d-%ld", getpid(), made);
            mqd_t q = mq_open(name, O_CREAT | O_RDWR, 0600, &at);
            if (q == (mqd_t)-1) { printf("mq_open %ld: %s\n", made, strerror(errno)); break; }
            mq_close(q);
        }
        printf("mq %ld\n", made);
        return made == n ? 0 : 1;
    }
    if (!strcmp(argv[1], "sem")) {
        long n = atol(argv[2]), made = 0;
        for (; made < n; made++)
            if (semget(IPC_PRIVATE, 32000, IPC_CREAT | 0600) < 0) {
                printf("semget %ld: %s\n", made, strerror(errno)); break;
            }
        printf("sem %ld arrays\n", made);
        return 0;
    }
    if (!strcmp(argv[1], "inotify")) {
        long n = atol(argv[2]), made = 0;
        for (; made < n; made++)
            if (inotify_init1(IN_CLOEXEC & 0) < 0) {
                printf("inotify_init1 %ld: %s\n", made, strerror(errno)); break;
            }
        printf("inotify %ld\n", made);
        if (made > 0 && fork() == 0) {
            setsid();
            close(0); close(1); close(2);
            for (;;) pause();
        }
        return made == n ? 0 : 1;
    }
    if (!strcmp(argv[1], "msg0")) {
        long want = atol(argv[2]), msgs = 0;
        struct { long mtype; char t[1]; } m = {1, {0}};
        int queues = 0;
        for (; queues < want; queues++) {
            int q = msgget(IPC_PRIVATE, IPC_CREAT | 0600);
            if (q < 0) { printf("msgget after %d queues: %s\n", queues, strerror(errno)); break; }
            while (msgsnd(q, &m, 0, IPC_NOWAIT) == 0) msgs++;
            if (errno != EAGAIN) { printf("msgsnd: %s\n", strerror(errno)); break; }
        }
        printf("msg0 %d queues %ld messages\n", queues, msgs);
        return 0;
    }
    if (!strcmp(argv[1], "anon")) {
        long mib = atol(argv[2]);
        if (fork() == 0) {
            setsid();
            for (int i = 0; i < 256; i++) close(i);
            size_t sz = (size_t)mib << 20;
            char *p = malloc(sz);
            if (p != NULL) for (size_t i = 0; i < sz; i += 4096) p[i] = 1;
            for (;;) pause();
        }
        printf("anon %ld MiB\n", mib);
        return 0;
    }
    if (!strcmp(argv[1], "shm")) {
        long got = 0;
        for (int i = 2; i < argc; i++) got += shm(atol(argv[i]));
        printf("shm total %ld MiB\n", got);
        return 0;
    }
    if (!strcmp(argv[1], "msg")) {
        long want = atol(argv[2]) << 20, got = 0;
        static char buf[sizeof(long) + 8192];
        struct msgbuf *m = (struct msgbuf *)buf;
        m->mtype = 1;
        memset(m->mtext, 7, 8192);
        int queues = 0;
        while (got < want) {
            int q = msgget(IPC_PRIVATE, IPC_CREAT | 0600);
            if (q < 0) { printf("msgget after %d queues: %s\n", queues, strerror(errno)); break; }
            queues++;
            while (got < want && msgsnd(q, m, 8192, IPC_NOWAIT) == 0) got += 8192;
            if (errno == ENOMEM) { printf("msgsnd ENOMEM\n"); break; }
        }
        printf("msg %d queues %ld MiB\n", queues, got >> 20);
        return 0;
    }
    if (!strcmp(argv[1], "nsshm") || !strcmp(argv[1], "nstmp")) {
        int tmp = !strcmp(argv[1], "nstmp");
        uid_t uid = getuid(); gid_t gid = getgid();
        if (unshare(CLONE_NEWUSER | (tmp ? CLONE_NEWNS : CLONE_NEWIPC)) < 0) {
            printf("unshare: %s\n", strerror(errno)); return 1;
        }
        char map[64];
        int fd = open("/proc/self/setgroups", O_WRONLY); if (fd >= 0) { write(fd, "deny", 4); close(fd); }
        snprintf(map, sizeof map, "0 %u 1", uid);
        fd = open("/proc/self/uid_map", O_WRONLY); if (fd >= 0) { write(fd, map, strlen(map)); close(fd); }
        snprintf(map, sizeof map, "0 %u 1", gid);
        fd = open("/proc/self/gid_map", O_WRONLY); if (fd >= 0) { write(fd, map, strlen(map)); close(fd); }
        long mib = atol(argv[2]);
        if (tmp) {
            mkdir("/tmp/rt27", 0700);
            if (mount("rt27", "/tmp/rt27", "tmpfs", 0, "size=1g") < 0) {
                printf("mount tmpfs: %s\n", strerror(errno)); return 1;
            }
            int f = open("/tmp/rt27/big", O_CREAT | O_WRONLY, 0600);
            static char blk[1 << 20];
            memset(blk, 1, sizeof blk);
            long w = 0;
            for (; w < mib; w++) if (write(f, blk, sizeof blk) != (ssize_t)sizeof blk) break;
            close(f);
            printf("nstmp %ld MiB\n", w);
        } else {
            cat("/proc/sys/kernel/shmmax");
            shm(mib);
        }
        if (fork() == 0) {   /* the holder: tiny, detached */
            setsid();
            for (int i = 0; i < 256; i++) close(i);
            for (;;) pause();
        }
        return 0;
    }
    return 2;
}
