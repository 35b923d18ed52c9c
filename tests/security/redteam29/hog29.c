/* Red team 29 helper (memory-group lowering deadline).
 *   hog29 share MIB N   a detached supervisor maps MIB of MAP_SHARED anonymous memory
 *                       (touches it once) and keeps N children alive, each of which maps
 *                       every page in (so each shows ~MIB of VmRSS); a child that dies is
 *                       replaced at once. Charged once; killing a child frees nothing.
 *   hog29 share MIB N churn   the same, the children writing every page round and round
 *   hog29 anon MIB      a detached process holding MIB of touched anonymous memory
 * Prints what it did on stdout. */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

static volatile char *mem;
static size_t sz;

static int churn;

static void child(void) {
    volatile char s = 0;
    for (size_t i = 0; i < sz; i += 4096) s += mem[i];
    (void)s;
    if (churn)      /* keep every page hot: each one reclaimed is faulted straight back */
        for (char v = 0;; v++) for (size_t i = 0; i < sz; i += 4096) mem[i] = v;
    for (;;) pause();
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IONBF, 0);
    if (argc < 3) return 2;
    long mib = atol(argv[2]);
    sz = (size_t)mib << 20;
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
    if (!strcmp(argv[1], "share") && argc >= 4) {
        int n = atoi(argv[3]);
        churn = argc >= 5 && !strcmp(argv[4], "churn");
        if (fork() != 0) { printf("share %ld MiB x %d\n", mib, n); return 0; }
        setsid();
        for (int i = 0; i < 256; i++) close(i);
        mem = mmap(NULL, sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (mem == MAP_FAILED) return 1;
        for (size_t i = 0; i < sz; i += 4096) mem[i] = 1;
        /* the supervisor drops its own page mappings: small RSS, never the largest */
        madvise((void *)mem, sz, MADV_DONTNEED);   /* (shmem: unmaps, keeps the pages) */
        for (int i = 0; i < n; i++) if (fork() == 0) child();
        for (;;) {
            if (wait(NULL) > 0 && fork() == 0) child();
        }
    }
    return 2;
}
