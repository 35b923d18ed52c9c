/* Minimal libfuse3 low-level daemon: one read-only file "f" served by pread from a
 * backing file. Used only by `dsec bench lazy` to measure what a C daemon would cost
 * per request against the pyfuse3 one (same page-cache settings: keep_cache). */
#define FUSE_USE_VERSION 34
#include <fuse_lowlevel.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <fcntl.h>
#include <unistd.h>
#include <sys/stat.h>

static int bfd;
static off_t bsize;

static void st(fuse_ino_t ino, struct stat *s) {
    memset(s, 0, sizeof *s);
    s->st_ino = ino;
    if (ino == 1) { s->st_mode = S_IFDIR | 0500; s->st_nlink = 2; }
    else { s->st_mode = S_IFREG | 0400; s->st_nlink = 1; s->st_size = bsize; }
}
static void ll_lookup(fuse_req_t req, fuse_ino_t parent, const char *name) {
    if (parent != 1 || strcmp(name, "f")) { fuse_reply_err(req, ENOENT); return; }
    struct fuse_entry_param e; memset(&e, 0, sizeof e);
    e.ino = 2; e.attr_timeout = e.entry_timeout = 86400; st(2, &e.attr);
    fuse_reply_entry(req, &e);
}
static void ll_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    struct stat s; st(ino, &s); fuse_reply_attr(req, &s, 86400);
}
static void ll_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    fi->keep_cache = 1; fuse_reply_open(req, fi);
}
static void ll_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                    struct fuse_file_info *fi) {
    char *buf = malloc(size);
    ssize_t n = pread(bfd, buf, size, off);
    if (n < 0) fuse_reply_err(req, errno); else fuse_reply_buf(req, buf, n);
    free(buf);
}
static const struct fuse_lowlevel_ops ops = {
    .lookup = ll_lookup, .getattr = ll_getattr, .open = ll_open, .read = ll_read,
};
int main(int argc, char **argv) {
    /* cfuse MOUNTPOINT BACKING */
    bfd = open(argv[2], O_RDONLY); if (bfd < 0) return 2;
    bsize = lseek(bfd, 0, SEEK_END);
    char *fargv[] = {argv[0], "-o", "ro,fsname=dsec-cbench", NULL};
    struct fuse_args args = FUSE_ARGS_INIT(3, fargv);
    struct fuse_session *se = fuse_session_new(&args, &ops, sizeof ops, NULL);
    if (!se || fuse_session_mount(se, argv[1])) return 1;
    printf("ready\n"); fflush(stdout);
    int rc = fuse_session_loop_mt(se, &(struct fuse_loop_config){.max_idle_threads = 10});
    fuse_session_unmount(se); fuse_session_destroy(se);
    return rc;
}
