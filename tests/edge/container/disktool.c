/* dsec disk red-team tool: one disk action per invocation, run inside a sandbox by
 * tests/edge/container/test_disk_hostile.py (compiled there with gcc -static and stacked
 * into the sandbox as a toolkit layer at /disktool). Prints "<action>=ok [value]" or
 * "<action>=E<errno>" so a test can tell what the kernel let through. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/xattr.h>
#include <linux/fs.h>

#ifndef FICLONE
#define FICLONE _IOW(0x94, 9, int)
#endif

static int res(const char *name, long r) {
    if (r < 0) { printf("%s=E%d\n", name, errno); return 1; }
    printf("%s=ok\n", name);
    return 0;
}

/* clonen SRC PREFIX N: N reflink copies of SRC (FICLONE) named PREFIX0..PREFIX<N-1>;
 * prints how many were made. */
static int clonen(const char *src, const char *prefix, long n) {
    int in = open(src, O_RDONLY);
    if (in < 0) return res("clonen", -1);
    long i;
    char name[4096];
    for (i = 0; i < n; i++) {
        snprintf(name, sizeof name, "%s%ld", prefix, i);
        int out = open(name, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (out < 0) break;
        if (ioctl(out, FICLONE, in) < 0) { close(out); unlink(name); break; }
        close(out);
    }
    if (i < n) printf("clonen=E%d %ld\n", errno, i); else printf("clonen=ok %ld\n", i);
    return 0;
}

/* cfrn SRC PREFIX N: like clonen with copy_file_range (btrfs makes it a reflink). */
static int cfrn(const char *src, const char *prefix, long n) {
    int in = open(src, O_RDONLY);
    if (in < 0) return res("cfrn", -1);
    struct stat st;
    fstat(in, &st);
    long i;
    char name[4096];
    for (i = 0; i < n; i++) {
        snprintf(name, sizeof name, "%s%ld", prefix, i);
        int out = open(name, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (out < 0) break;
        loff_t a = 0, b = 0;
        ssize_t left = st.st_size, r = 0;
        while (left > 0 && (r = copy_file_range(in, &a, out, &b, left, 0)) > 0) left -= r;
        close(out);
        if (r < 0) { unlink(name); break; }
    }
    if (i < n) printf("cfrn=E%d %ld\n", errno, i); else printf("cfrn=ok %ld\n", i);
    return 0;
}

/* setflags PATH FLAGHEX: FS_IOC_SETFLAGS |= FLAGHEX (0x4 = FS_COMPR_FL, 0x800000 = NOCOW,
 * 0x10 = immutable). */
static int setflags(const char *path, const char *hex) {
    int fd = open(path, O_RDONLY | O_NONBLOCK);
    if (fd < 0) return res("setflags", -1);
    int flags = 0;
    if (ioctl(fd, FS_IOC_GETFLAGS, &flags) < 0) return res("setflags", -1);
    flags |= (int)strtol(hex, NULL, 16);
    return res("setflags", ioctl(fd, FS_IOC_SETFLAGS, &flags));
}

/* ioctl PATH NR SIZE DIR: a raw btrfs ioctl (type 0x94) with a zeroed 4 KiB buffer. */
static int rawioctl(const char *path, long nr, long size, long dir) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) return res("ioctl", -1);
    static char buf[65536];
    unsigned long req = ((unsigned long)dir << 30) | ((unsigned long)size << 16) | (0x94 << 8) | nr;
    if (nr == 14 || nr == 24 || nr == 1 || nr == 23) /* SUBVOL_CREATE(_V2), SNAP_CREATE(_V2) */
        strcpy(buf + (nr == 24 || nr == 23 ? 48 : 8), "escape");
    return res("ioctl", ioctl(fd, req, buf));
}

/* sparsechop PATH SIZE STEP: a SIZE-byte file with one distinct 4 KiB data block every
 * STEP bytes (as many extents as SIZE/STEP). */
static int sparsechop(const char *path, long long size, long long step) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return res("sparsechop", -1);
    char block[4096];
    memset(block, 'x', sizeof block);
    long long off, n = 0;
    for (off = 0; off < size; off += step) {
        memcpy(block, &off, sizeof off);          /* every block differs: no dedup */
        if (pwrite(fd, block, sizeof block, off) != sizeof block) {
            printf("sparsechop=E%d %lld\n", errno, n);
            return 0;
        }
        n++;
    }
    if (ftruncate(fd, size) < 0) return res("sparsechop", -1);
    printf("sparsechop=ok %lld\n", n);
    return 0;
}

/* rand PATH BYTES: BYTES of incompressible data. */
static int randfile(const char *path, long long bytes) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return res("rand", -1);
    static unsigned char buf[1 << 16];
    uint64_t x = 88172645463325252ull ^ (uint64_t)getpid();
    long long done = 0;
    while (done < bytes) {
        for (size_t i = 0; i < sizeof buf; i += 8) {
            x ^= x << 13; x ^= x >> 7; x ^= x << 17;
            memcpy(buf + i, &x, 8);
        }
        long long want = bytes - done < (long long)sizeof buf ? bytes - done : (long long)sizeof buf;
        ssize_t w = write(fd, buf, want);
        if (w <= 0) { printf("rand=E%d %lld\n", errno, done); return 0; }
        done += w;
    }
    fsync(fd);
    printf("rand=ok %lld\n", done);
    return 0;
}

/* mkfiles DIR N: N empty files in DIR (made first); prints how many were made. */
static int mkfiles(const char *dir, long n) {
    mkdir(dir, 0755);
    int d = open(dir, O_RDONLY | O_DIRECTORY);
    if (d < 0) return res("mkfiles", -1);
    long i;
    char name[64];
    for (i = 0; i < n; i++) {
        snprintf(name, sizeof name, "%ld", i);
        int fd = openat(d, name, O_WRONLY | O_CREAT | O_EXCL, 0644);
        if (fd < 0) break;
        close(fd);
    }
    if (i < n) printf("mkfiles=E%d %ld\n", errno, i); else printf("mkfiles=ok %ld\n", i);
    return 0;
}

/* deep DIR DEPTH NAMELEN FILES: a chain of DEPTH directories with NAMELEN-char names
 * under DIR, then FILES empty files with NAMELEN-char names at the bottom (long paths,
 * little metadata). Prints how many files were made. */
static int deep(const char *dir, long depth, long namelen, long files) {
    char name[256];
    if (namelen > 200) namelen = 200;
    memset(name, 'd', namelen);
    name[namelen] = 0;
    mkdir(dir, 0755);
    int d = open(dir, O_RDONLY | O_DIRECTORY);
    for (long i = 0; i < depth && d >= 0; i++) {
        mkdirat(d, name, 0755);
        int n = openat(d, name, O_RDONLY | O_DIRECTORY);
        close(d);
        d = n;
    }
    if (d < 0) return res("deep", -1);
    long i;
    for (i = 0; i < files; i++) {
        snprintf(name, sizeof name, "%0*ld", (int)namelen, i);
        int fd = openat(d, name, O_WRONLY | O_CREAT | O_EXCL, 0644);
        if (fd < 0) break;
        close(fd);
    }
    if (i < files) printf("deep=E%d %ld\n", errno, i); else printf("deep=ok %ld\n", i);
    return 0;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IONBF, 0);
    if (argc < 2) return 2;
    const char *a = argv[1];
    if (!strcmp(a, "clonen") && argc == 5) return clonen(argv[2], argv[3], atol(argv[4]));
    if (!strcmp(a, "cfrn") && argc == 5) return cfrn(argv[2], argv[3], atol(argv[4]));
    if (!strcmp(a, "setflags") && argc == 4) return setflags(argv[2], argv[3]);
    if (!strcmp(a, "setxattr") && argc == 5)
        return res("setxattr", setxattr(argv[2], argv[3], argv[4], strlen(argv[4]), 0));
    if (!strcmp(a, "ioctl") && argc == 6)
        return rawioctl(argv[2], atol(argv[3]), atol(argv[4]), atol(argv[5]));
    if (!strcmp(a, "sparsechop") && argc == 5)
        return sparsechop(argv[2], atoll(argv[3]), atoll(argv[4]));
    if (!strcmp(a, "mkfiles") && argc == 4) return mkfiles(argv[2], atol(argv[3]));
    if (!strcmp(a, "deep") && argc == 6)
        return deep(argv[2], atol(argv[3]), atol(argv[4]), atol(argv[5]));
    if (!strcmp(a, "rand") && argc == 4) return randfile(argv[2], atoll(argv[3]));
    fprintf(stderr, "usage: disktool clonen|cfrn|setflags|setxattr|ioctl|sparsechop|mkfiles|deep|rand ...\n");
    return 2;
}
