/* Red team 30 helper (memory-group lowering deadline).
 *   hog30 memfd MIB   a detached process that writes MIB into a memfd it never maps and
 *                     keeps the fd open: shmem pages charged to its memory cgroup, in no
 *                     process's PSS/RSS, not SysV, not under /tmp (statvfs sees none).
 *   hog30 anon MIB    a detached process holding MIB of touched anonymous memory.
 *   hog30 cow MIB N   a detached process touches MIB of private anonymous memory and
 *                     forks N children that keep it copy-on-write shared (a pre-fork
 *                     server): each shows MIB/(N+1) of PSS; killing one frees nothing.
 *   hog30 filechurn PATH MIB N   writes MIB to the regular file PATH (fsync: clean page
 *                     cache), maps it MAP_SHARED read-only and leaves N detached children
 *                     reading every page round and round (each page reclaimed is read
 *                     straight back in).
 * Prints what it did on stdout. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <fcntl.h>
#include <unistd.h>

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IONBF, 0);
    if (argc < 3) return 2;
    long mib = atol(argv[2]);
    size_t sz = (size_t)mib << 20;
    if (!strcmp(argv[1], "memfd")) {
        int fd = memfd_create("rt30", 0);
        if (fd < 0) { perror("memfd_create"); return 1; }
        static char buf[1 << 20];
        memset(buf, 1, sizeof buf);
        for (long i = 0; i < mib; i++)
            if (write(fd, buf, sizeof buf) != (ssize_t)sizeof buf) { perror("write"); return 1; }
        if (fork() == 0) {
            setsid();
            for (int i = 0; i < 256; i++) if (i != fd) close(i);
            for (;;) pause();
        }
        printf("memfd %ld MiB\n", mib);
        return 0;
    }
    if (!strcmp(argv[1], "anon")) {
        if (fork() == 0) {
            setsid();
            for (int i = 0; i < 256; i++) close(i);
            char *p = malloc(sz);
            if (p != NULL) for (size_t i = 0; i < sz; i += 4096) p[i] = 1;
            for (;;) pause();
        }
        printf("anon %ld MiB\n", mib);
        return 0;
    }
    if (!strcmp(argv[1], "filechurn") && argc >= 5) {
        mib = atol(argv[3]);
        sz = (size_t)mib << 20;
        int n = atoi(argv[4]);
        int fd = open(argv[2], O_RDWR | O_CREAT | O_TRUNC, 0600);
        if (fd < 0) { perror("open"); return 1; }
        static char buf[1 << 20];
        memset(buf, 1, sizeof buf);
        for (long i = 0; i < mib; i++)
            if (write(fd, buf, sizeof buf) != (ssize_t)sizeof buf) { perror("write"); return 1; }
        fsync(fd);
        volatile char *m = mmap(NULL, sz, PROT_READ, MAP_SHARED, fd, 0);
        if (m == MAP_FAILED) { perror("mmap"); return 1; }
        for (int k = 0; k < n; k++) if (fork() == 0) {
            setsid();
            for (int i = 0; i < 256; i++) close(i);
            volatile char s = 0;
            for (;;) for (size_t i = 0; i < sz; i += 4096) s += m[i];
        }
        printf("filechurn %ld MiB x %d\n", mib, n);
        return 0;
    }
    if (!strcmp(argv[1], "cow") && argc >= 4) {
        int n = atoi(argv[3]);
        if (fork() == 0) {
            setsid();
            for (int i = 0; i < 256; i++) close(i);
            char *p = malloc(sz);
            if (p != NULL) for (size_t i = 0; i < sz; i += 4096) p[i] = 1;
            for (int i = 0; i < n; i++) if (fork() == 0) for (;;) pause();
            for (;;) pause();
        }
        printf("cow %ld MiB x %d\n", mib, n);
        return 0;
    }
    return 2;
}
