/* dsec-vm-agent: PID 1 of a dsec microVM guest (docs/vm.md).
 *
 * Boot: mount /proc, /sys, /dev (devtmpfs); load the kernel modules listed in
 * /lib/modules/load.order (finit_module, dependency order chosen by the host); find the
 * virtio-serial port named "dsec.agent" under /sys/class/virtio-ports; then serve Aether
 * calls on it forever (agentproto.py lists the methods and bodies).
 *
 * One thread, one poll loop: the port, a signalfd (SIGCHLD, SIGIO) and the pipes of the
 * running execs. Output to the host is buffered and written non-blocking: a blocking
 * write on a virtio port whose host side is closed sleeps until a host connects again,
 * and would then deliver a stale half frame to the new connection. When the host side
 * closes (POLLHUP), the agent drops its buffers and the calls in flight (killing their
 * foreground execs: nobody can receive their result), keeps background processes and
 * mounts, and waits for SIGIO (sent by the kernel on the port's open/close control
 * message) to serve the next connection. The frame parser resynchronises on the next
 * valid header after garbage, so a reconnect racing a partial frame costs one frame.
 *
 * Test mode (not PID 1): `dsec-vm-agent --fd N --root DIR` serves on fd N (a socket)
 * with DIR as the sandbox root and no mounts; used only by tests and debugging.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <linux/openat2.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/reboot.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/types.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

#define PROTO_VERSION 1
#define MAX_FRAME (4u * 1024 * 1024)
#define MAX_READ (2u * 1024 * 1024)
/* per-stream output a unary exec keeps: both streams must fit one reply frame */
#define MAX_EXEC_OUTPUT ((MAX_FRAME - 64u * 1024) / 2)
#define HDR 25
#define OUT_HIGH (2u * 1024 * 1024)      /* stop reading exec pipes above this */
#define MAX_EXECS 256
#define SB "/sb"

enum { T_REQUEST = 1, T_RESPONSE, T_ERROR, T_STREAM, T_CANCEL, T_PING, T_PONG, T_GOAWAY, T_WINDOW };
#define F_STREAMING 1
#define F_CREDIT 8
#define STREAM_WINDOW (4LL * 1024 * 1024)   /* Aether's per-stream push credit */

static void logf_(const char *fmt, ...) {
    char b[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(b, sizeof b - 1, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if (n > (int)sizeof b - 2) n = sizeof b - 2;
    b[n++] = '\n';
    ssize_t w = write(2, "dsec-agent: ", 12);
    w = write(2, b, n);
    (void)w;
}

static double now_mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* ---------------------------------------------------------------- CRC-32 (IEEE) */
static uint32_t crc_tab[256];
static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_tab[i] = c;
    }
}
static uint32_t crc32_upd(uint32_t crc, const uint8_t *p, size_t n) {
    crc = ~crc;
    while (n--) crc = crc_tab[(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return ~crc;
}

/* ---------------------------------------------------------------- byte buffers */
typedef struct { uint8_t *p; size_t len, cap; } buf_t;
static void buf_reserve(buf_t *b, size_t extra) {
    if (b->len + extra <= b->cap) return;
    size_t nc = b->cap ? b->cap : 256;
    while (nc < b->len + extra) nc *= 2;
    uint8_t *np = realloc(b->p, nc);
    if (!np) { logf_("out of memory (%zu bytes)", nc); reboot(RB_POWER_OFF); _exit(1); }
    b->p = np; b->cap = nc;
}
static void buf_put(buf_t *b, const void *d, size_t n) {
    buf_reserve(b, n);
    memcpy(b->p + b->len, d, n);
    b->len += n;
}
static void buf_u8(buf_t *b, uint8_t v) { buf_put(b, &v, 1); }
static void buf_be(buf_t *b, uint64_t v, int n) {
    uint8_t t[8];
    for (int i = 0; i < n; i++) t[i] = (uint8_t)(v >> (8 * (n - 1 - i)));
    buf_put(b, t, n);
}
static void buf_free(buf_t *b) { free(b->p); b->p = NULL; b->len = b->cap = 0; }
static void buf_consume(buf_t *b, size_t n) {
    memmove(b->p, b->p + n, b->len - n);
    b->len -= n;
    if (b->cap > (1u << 20) && b->len < b->cap / 4) {   /* give big buffers back */
        uint8_t *np = realloc(b->p, b->len ? b->len : 64);
        if (np) { b->p = np; b->cap = b->len ? b->len : 64; }
    }
}

/* ---------------------------------------------------------------- msgpack writer */
static void mp_bool(buf_t *b, int v) { buf_u8(b, v ? 0xc3 : 0xc2); }
static void mp_int(buf_t *b, int64_t v) {
    if (v >= 0) {
        if (v < 128) buf_u8(b, (uint8_t)v);
        else if (v < 65536) { buf_u8(b, 0xcd); buf_be(b, v, 2); }
        else if (v <= 0xffffffffLL) { buf_u8(b, 0xce); buf_be(b, v, 4); }
        else { buf_u8(b, 0xcf); buf_be(b, v, 8); }
    } else if (v >= -32) buf_u8(b, (uint8_t)(int8_t)v);
    else { buf_u8(b, 0xd3); buf_be(b, (uint64_t)v, 8); }
}
static void mp_float(buf_t *b, double d) {
    uint64_t u; memcpy(&u, &d, 8);
    buf_u8(b, 0xcb); buf_be(b, u, 8);
}
static void mp_strn(buf_t *b, const char *s, size_t n) {
    if (n < 32) buf_u8(b, 0xa0 | n);
    else if (n < 256) { buf_u8(b, 0xd9); buf_u8(b, n); }
    else if (n < 65536) { buf_u8(b, 0xda); buf_be(b, n, 2); }
    else { buf_u8(b, 0xdb); buf_be(b, n, 4); }
    buf_put(b, s, n);
}
static void mp_str(buf_t *b, const char *s) { mp_strn(b, s, strlen(s)); }
static void mp_bin(buf_t *b, const void *d, size_t n) {
    if (n < 256) { buf_u8(b, 0xc4); buf_u8(b, n); }
    else if (n < 65536) { buf_u8(b, 0xc5); buf_be(b, n, 2); }
    else { buf_u8(b, 0xc6); buf_be(b, n, 4); }
    buf_put(b, d, n);
}
static void mp_map(buf_t *b, uint32_t n) {
    if (n < 16) buf_u8(b, 0x80 | n);
    else { buf_u8(b, 0xde); buf_be(b, n, 2); }
}
static void mp_arr(buf_t *b, uint32_t n) {
    if (n < 16) buf_u8(b, 0x90 | n);
    else if (n < 65536) { buf_u8(b, 0xdc); buf_be(b, n, 2); }
    else { buf_u8(b, 0xdd); buf_be(b, n, 4); }
}
/* the array header for a count known only at the end: always 5 bytes, patched later */
static size_t mp_arr32_placeholder(buf_t *b) { size_t at = b->len; buf_u8(b, 0xdd); buf_be(b, 0, 4); return at; }
static void mp_arr32_patch(buf_t *b, size_t at, uint32_t n) {
    for (int i = 0; i < 4; i++) b->p[at + 1 + i] = (uint8_t)(n >> (8 * (3 - i)));
}

/* ---------------------------------------------------------------- msgpack reader
 * A value is a (pointer, end) cursor; maps are searched by key per lookup. Every read
 * is bounds-checked; nesting is limited so a hostile body cannot recurse deeply. */
typedef struct { const uint8_t *p, *e; } mp_t;
enum { MP_ERR = -1, MP_NIL, MP_BOOL, MP_INT, MP_FLOAT, MP_STR, MP_BIN, MP_ARR, MP_MAP, MP_EXT };

static uint64_t rd_be(const uint8_t *p, int n) { uint64_t v = 0; for (int i = 0; i < n; i++) v = v << 8 | p[i]; return v; }

/* decode the head of the value at c->p: type, and (len for str/bin/arr/map, or int/float
 * value); *hdr = header size. Returns MP_ERR on truncation. */
typedef struct { int type; uint64_t n; int64_t i; double f; size_t hdr; } mphead_t;
static int mp_head(const uint8_t *p, const uint8_t *e, mphead_t *h) {
    if (p >= e) return MP_ERR;
    uint8_t t = *p;
    size_t avail = e - p;
    memset(h, 0, sizeof *h);
    h->hdr = 1;
#define NEED(k) do { if (avail < (size_t)(k)) return MP_ERR; } while (0)
    if (t <= 0x7f) { h->type = MP_INT; h->i = t; }
    else if (t >= 0xe0) { h->type = MP_INT; h->i = (int8_t)t; }
    else if ((t & 0xf0) == 0x80) { h->type = MP_MAP; h->n = t & 0xf; }
    else if ((t & 0xf0) == 0x90) { h->type = MP_ARR; h->n = t & 0xf; }
    else if ((t & 0xe0) == 0xa0) { h->type = MP_STR; h->n = t & 0x1f; }
    else switch (t) {
    case 0xc0: h->type = MP_NIL; break;
    case 0xc2: case 0xc3: h->type = MP_BOOL; h->i = t == 0xc3; break;
    case 0xc4: case 0xc5: case 0xc6: { int k = 1 << (t - 0xc4); NEED(1 + k); h->type = MP_BIN; h->n = rd_be(p + 1, k); h->hdr = 1 + k; break; }
    case 0xd9: case 0xda: case 0xdb: { int k = 1 << (t - 0xd9); NEED(1 + k); h->type = MP_STR; h->n = rd_be(p + 1, k); h->hdr = 1 + k; break; }
    case 0xcc: case 0xcd: case 0xce: case 0xcf: { int k = 1 << (t - 0xcc); NEED(1 + k); h->type = MP_INT; uint64_t u = rd_be(p + 1, k); if (u > INT64_MAX) return MP_ERR; h->i = (int64_t)u; h->hdr = 1 + k; break; }
    case 0xd0: case 0xd1: case 0xd2: case 0xd3: { int k = 1 << (t - 0xd0); NEED(1 + k); uint64_t u = rd_be(p + 1, k); int sh = 64 - 8 * k; h->type = MP_INT; h->i = (int64_t)(u << sh) >> sh; h->hdr = 1 + k; break; }
    case 0xca: { NEED(5); uint32_t u = (uint32_t)rd_be(p + 1, 4); float f; memcpy(&f, &u, 4); h->type = MP_FLOAT; h->f = f; h->hdr = 5; break; }
    case 0xcb: { NEED(9); uint64_t u = rd_be(p + 1, 8); memcpy(&h->f, &u, 8); h->type = MP_FLOAT; h->hdr = 9; break; }
    case 0xdc: NEED(3); h->type = MP_ARR; h->n = rd_be(p + 1, 2); h->hdr = 3; break;
    case 0xdd: NEED(5); h->type = MP_ARR; h->n = rd_be(p + 1, 4); h->hdr = 5; break;
    case 0xde: NEED(3); h->type = MP_MAP; h->n = rd_be(p + 1, 2); h->hdr = 3; break;
    case 0xdf: NEED(5); h->type = MP_MAP; h->n = rd_be(p + 1, 4); h->hdr = 5; break;
    case 0xd4: NEED(2); h->type = MP_EXT; h->n = 1; h->hdr = 2; break;
    case 0xd5: NEED(2); h->type = MP_EXT; h->n = 2; h->hdr = 2; break;
    case 0xd6: NEED(2); h->type = MP_EXT; h->n = 4; h->hdr = 2; break;
    case 0xd7: NEED(2); h->type = MP_EXT; h->n = 8; h->hdr = 2; break;
    case 0xd8: NEED(2); h->type = MP_EXT; h->n = 16; h->hdr = 2; break;
    case 0xc7: case 0xc8: case 0xc9: { int k = 1 << (t - 0xc7); NEED(2 + k); h->type = MP_EXT; h->n = rd_be(p + 1, k); h->hdr = 2 + k; break; }
    default: return MP_ERR;
    }
    if ((h->type == MP_STR || h->type == MP_BIN || h->type == MP_EXT) && h->n > avail - h->hdr) return MP_ERR;
    return h->type;
#undef NEED
}

/* pointer past the value at p, or NULL if malformed / nested deeper than depth */
static const uint8_t *mp_skip(const uint8_t *p, const uint8_t *e, int depth) {
    mphead_t h;
    if (depth > 32 || mp_head(p, e, &h) == MP_ERR) return NULL;
    p += h.hdr;
    if (h.type == MP_STR || h.type == MP_BIN || h.type == MP_EXT) return p + h.n;
    if (h.type == MP_ARR || h.type == MP_MAP) {
        uint64_t k = h.type == MP_MAP ? h.n * 2 : h.n;
        if (k > (uint64_t)(e - p)) return NULL;  /* each item is >= 1 byte */
        for (uint64_t i = 0; i < k; i++) if (!(p = mp_skip(p, e, depth + 1))) return NULL;
    }
    return p;
}

/* find key in the map at m; *v = its value. 1 found, 0 absent, -1 malformed/not a map */
static int mp_get(mp_t m, const char *key, mp_t *v) {
    mphead_t h;
    if (mp_head(m.p, m.e, &h) != MP_MAP) return m.p < m.e && *m.p == 0xc0 ? 0 : -1;
    const uint8_t *p = m.p + h.hdr;
    size_t kl = strlen(key);
    for (uint64_t i = 0; i < h.n; i++) {
        mphead_t kh;
        if (mp_head(p, m.e, &kh) == MP_ERR) return -1;
        const uint8_t *kend = mp_skip(p, m.e, 0);
        if (!kend) return -1;
        const uint8_t *vend = mp_skip(kend, m.e, 0);
        if (!vend) return -1;
        if (kh.type == MP_STR && kh.n == kl && memcmp(p + kh.hdr, key, kl) == 0) {
            v->p = kend; v->e = vend;
            return 1;
        }
        p = vend;
    }
    return 0;
}

/* request-body decoding errors: set once, reported as invalid_argument */
static char body_err[256];
static void bad_field(const char *key, const char *want) {
    if (!body_err[0]) snprintf(body_err, sizeof body_err, "field %s must be %s", key, want);
}
/* a C string copy of str field key (malloc'd), def if absent or nil */
static char *get_str(mp_t m, const char *key, const char *def) {
    mp_t v; mphead_t h;
    int r = mp_get(m, key, &v);
    if (r < 0) { bad_field("(body)", "a map"); return NULL; }
    if (r == 0 || mp_head(v.p, v.e, &h) == MP_NIL) return def ? strdup(def) : NULL;
    if (h.type != MP_STR || memchr(v.p + h.hdr, 0, h.n)) { bad_field(key, "a string without NUL"); return NULL; }
    return strndup((const char *)v.p + h.hdr, h.n);
}
static int64_t get_int(mp_t m, const char *key, int64_t def) {
    mp_t v; mphead_t h;
    if (mp_get(m, key, &v) != 1 || mp_head(v.p, v.e, &h) == MP_NIL) return def;
    if (h.type == MP_INT) return h.i;
    if (h.type == MP_FLOAT) return (int64_t)h.f;
    bad_field(key, "an integer");
    return def;
}
static double get_float(mp_t m, const char *key, double def, int *is_nil) {
    mp_t v; mphead_t h;
    if (is_nil) *is_nil = 0;
    if (mp_get(m, key, &v) != 1) return def;
    int t = mp_head(v.p, v.e, &h);
    if (t == MP_NIL) { if (is_nil) *is_nil = 1; return def; }
    if (t == MP_FLOAT) return h.f;
    if (t == MP_INT) return (double)h.i;
    bad_field(key, "a number");
    return def;
}
static int get_bool(mp_t m, const char *key, int def) {
    mp_t v; mphead_t h;
    if (mp_get(m, key, &v) != 1 || mp_head(v.p, v.e, &h) == MP_NIL) return def;
    if (h.type == MP_BOOL) return (int)h.i;
    bad_field(key, "a boolean");
    return def;
}
/* bin (or str) field: pointer into the body and its length */
static const uint8_t *get_bin(mp_t m, const char *key, size_t *n) {
    mp_t v; mphead_t h;
    *n = 0;
    if (mp_get(m, key, &v) != 1 || mp_head(v.p, v.e, &h) == MP_NIL) return NULL;
    if (h.type != MP_BIN && h.type != MP_STR) { bad_field(key, "bytes"); return NULL; }
    *n = h.n;
    return v.p + h.hdr;
}
/* a NULL-terminated array of malloc'd strings from an array-of-str (arr) or a
 * map str->str as "k=v" (map); NULL and *n=0 when absent */
static char **get_strv(mp_t m, const char *key, int as_env, size_t *count) {
    mp_t v; mphead_t h;
    *count = 0;
    if (mp_get(m, key, &v) != 1 || mp_head(v.p, v.e, &h) == MP_NIL) return NULL;
    if (h.type != (as_env ? MP_MAP : MP_ARR) || h.n > 65536) { bad_field(key, as_env ? "a map of strings" : "an array of strings"); return NULL; }
    uint64_t items = h.n;
    char **out = calloc(items + 1, sizeof *out);
    const uint8_t *p = v.p + h.hdr;
    for (uint64_t i = 0; i < items; i++) {
        mphead_t a, b;
        if (mp_head(p, v.e, &a) != MP_STR || memchr(p + a.hdr, 0, a.n)) goto bad;
        const uint8_t *as = p + a.hdr; p = as + a.n;
        if (as_env) {
            if (mp_head(p, v.e, &b) != MP_STR || memchr(p + b.hdr, 0, b.n) || memchr(as, '=', a.n)) goto bad;
            const uint8_t *bs = p + b.hdr; p = bs + b.n;
            char *s = malloc(a.n + b.n + 2);
            memcpy(s, as, a.n); s[a.n] = '='; memcpy(s + a.n + 1, bs, b.n); s[a.n + b.n + 1] = 0;
            out[i] = s;
        } else out[i] = strndup((const char *)as, a.n);
        *count = i + 1;
    }
    return out;
bad:
    bad_field(key, as_env ? "a map of strings (names without '=' or NUL)" : "an array of strings without NUL");
    for (size_t i = 0; out[i]; i++) free(out[i]);
    free(out);
    *count = 0;
    return NULL;
}
static void free_strv(char **v) { if (!v) return; for (size_t i = 0; v[i]; i++) free(v[i]); free(v); }

/* ---------------------------------------------------------------- connection I/O */
static int port_fd = -1;
static int connected = 0;
static unsigned connections = 0;
static buf_t inb, outb;

static void send_frame(int type, uint64_t sid, const uint8_t *payload, size_t n, int flags) {
    if (!connected) return;
    uint8_t h[HDR];
    memcpy(h, "AETH", 4);
    h[4] = 0; h[5] = 1;
    for (int i = 0; i < 8; i++) h[6 + i] = (uint8_t)(sid >> (8 * (7 - i)));
    h[14] = (uint8_t)type;
    for (int i = 0; i < 4; i++) h[15 + i] = (uint8_t)(n >> (8 * (3 - i)));
    h[19] = (uint8_t)(flags >> 8); h[20] = (uint8_t)flags;
    uint32_t c = crc32_upd(crc32_upd(0, h, 21), payload, n);
    for (int i = 0; i < 4; i++) h[21 + i] = (uint8_t)(c >> (8 * (3 - i)));
    buf_put(&outb, h, HDR);
    if (n) buf_put(&outb, payload, n);
}
static void send_body(int type, uint64_t sid, buf_t *body) { send_frame(type, sid, body->p, body->len, 0); }

static void send_error(uint64_t sid, const char *code, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    buf_t b = {0};
    mp_map(&b, 2);
    mp_str(&b, "code"); mp_str(&b, code);
    mp_str(&b, "message"); mp_str(&b, msg);
    send_body(T_ERROR, sid, &b);
    buf_free(&b);
}
static const char *errno_code(int e) {
    switch (e) {
    case ENOENT: case ENOTDIR: return "not_found";
    case EEXIST: case ENOTEMPTY: case EBUSY: return "conflict";
    case EACCES: case EPERM: case EROFS: return "permission_denied";
    case ENOSPC: case EDQUOT: case ENOMEM: case EMFILE: case ENFILE: return "resource_exhausted";
    case EXDEV: case ELOOP: case EINVAL: case EISDIR: case ENAMETOOLONG: return "invalid_argument";
    case EFBIG: return "payload_too_large";
    default: return "backend_error";
    }
}
static void send_errno(uint64_t sid, int e, const char *what, const char *path) {
    send_error(sid, errno_code(e), "%s %s: %s", what, path ? path : "", strerror(e));
}

static void flush_out(void) {
    while (connected && outb.len) {
        ssize_t w = write(port_fd, outb.p, outb.len > (1u << 20) ? (1u << 20) : outb.len);
        if (w > 0) { buf_consume(&outb, (size_t)w); continue; }
        if (w < 0 && errno == EINTR) continue;
        break;  /* EAGAIN: the poll loop waits for POLLOUT; other errors: HUP handling */
    }
}

/* ---------------------------------------------------------------- state */
static int setup_done = 0;
static pid_t modules_pid = 0;       /* the child loading kernel modules at boot (0: done) */
static int root_fd = -1;            /* O_PATH of the sandbox root (/sb), after setup */
static char sb_path[PATH_MAX] = SB;
static char **base_env = NULL;
static size_t base_env_n = 0;
static char boot_id[64] = "";
static double t_boot;
static int test_mode = 0;

typedef struct {
    int used;
    uint64_t sid;                   /* 0: no caller (background, or caller gone) */
    int kind;                       /* 0 exec, 1 exec_stream, 2 diff, 3 background */
    pid_t pid;
    int out_fd, err_fd, in_fd, cnt_fd;
    buf_t out, err, in;
    size_t in_off;
    int64_t cap;
    int out_trunc, err_trunc;
    int exited, status;
    double start, deadline, exit_at;
    int timed_out;
    size_t cnt[2];                  /* exec_stream: stdout/stderr bytes sent (for the cap) */
    int64_t credit;                 /* STREAM bytes the caller still accepts (Aether CREDIT) */
    uint64_t streamed;              /* diff: bytes sent */
    uint64_t counts[3];             /* diff: entries, skipped, (unused) */
    int oom_before;
} job_t;
static job_t jobs[MAX_EXECS];
static int cur_flags = 0;           /* flags of the REQUEST being dispatched */
static int64_t initial_credit(void) { return (cur_flags & F_CREDIT) ? STREAM_WINDOW : INT64_MAX; }

static long read_vmstat(const char *key) {
    FILE *f = fopen("/proc/vmstat", "re");
    if (!f) return 0;
    char k[64]; long v, r = 0;
    while (fscanf(f, "%63s %ld", k, &v) == 2) if (!strcmp(k, key)) { r = v; break; }
    fclose(f);
    return r;
}
static long meminfo(const char *key) {
    FILE *f = fopen("/proc/meminfo", "re");
    if (!f) return 0;
    char line[256]; long r = 0; size_t kl = strlen(key);
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, key, kl) && line[kl] == ':') { r = atol(line + kl + 1) * 1024; break; }
    fclose(f);
    return r;
}

/* ---------------------------------------------------------------- confined paths */
static int open_in_root(const char *path, int flags, mode_t mode) {
    struct open_how how = { .flags = (uint64_t)flags | O_CLOEXEC, .mode = (flags & O_CREAT) ? mode : 0,
                            .resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS };
    int fd;
    do fd = (int)syscall(SYS_openat2, root_fd, path, &how, sizeof how); while (fd < 0 && errno == EINTR);
    return fd;
}
/* split path into an open parent directory (O_PATH) and the last component (copied
 * into base). Refuses "", "/", "." and ".." as last component. */
static int open_parent(const char *path, char *base, size_t bsz) {
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') n--;
    size_t s = n;
    while (s > 0 && path[s - 1] != '/') s--;
    size_t bl = n - s;
    if (bl == 0 || bl >= bsz || bl > NAME_MAX) { errno = EINVAL; return -1; }
    memcpy(base, path + s, bl); base[bl] = 0;
    if (!strcmp(base, ".") || !strcmp(base, "..")) { errno = EINVAL; return -1; }
    char dir[PATH_MAX];
    if (s >= sizeof dir) { errno = ENAMETOOLONG; return -1; }
    if (s == 0) strcpy(dir, ".");
    else { memcpy(dir, path, s); dir[s] = 0; }
    return open_in_root(dir, O_PATH | O_DIRECTORY, 0);
}
static int mkdirs(const char *path, mode_t mode) {
    char tmp[PATH_MAX];
    size_t n = strlen(path);
    if (n >= sizeof tmp) { errno = ENAMETOOLONG; return -1; }
    memcpy(tmp, path, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (tmp[i] != '/' && tmp[i] != 0) continue;
        if (tmp[i - 1] == '/') continue;
        char c = tmp[i]; tmp[i] = 0;
        char base[NAME_MAX + 1];
        int pfd = open_parent(tmp, base, sizeof base);
        if (pfd < 0) { if (errno == EINVAL) { tmp[i] = c; continue; } return -1; }
        int r = mkdirat(pfd, base, mode);
        int e = errno;
        close(pfd);
        if (r < 0 && e != EEXIST) { errno = e; return -1; }
        tmp[i] = c;
    }
    return 0;
}

static const char *ftype(mode_t m) {
    return S_ISREG(m) ? "file" : S_ISDIR(m) ? "dir" : S_ISLNK(m) ? "symlink" : "other";
}
static void put_fileinfo(buf_t *b, const char *name, const char *path, const struct stat *st, int dirfd, const char *lname) {
    char target[PATH_MAX];
    ssize_t tl = -1;
    if (S_ISLNK(st->st_mode)) tl = readlinkat(dirfd, lname, target, sizeof target - 1);
    mp_map(b, tl >= 0 ? 7 : 6);
    mp_str(b, "name"); mp_str(b, name);
    mp_str(b, "path"); mp_str(b, path);
    mp_str(b, "type"); mp_str(b, ftype(st->st_mode));
    mp_str(b, "size"); mp_int(b, st->st_size);
    mp_str(b, "mode"); mp_int(b, st->st_mode & 07777);
    mp_str(b, "mtime"); mp_float(b, st->st_mtim.tv_sec + st->st_mtim.tv_nsec / 1e9);
    if (tl >= 0) { mp_str(b, "link_target"); mp_strn(b, target, (size_t)tl); }
}

static void h_stat(uint64_t sid, mp_t body) {
    char *path = get_str(body, "path", NULL);
    if (!path) { send_error(sid, "invalid_argument", "stat: %s", body_err[0] ? body_err : "path missing"); return; }
    char base[NAME_MAX + 1];
    struct stat st;
    buf_t b = {0};
    const char *norm = path;
    while (*norm == '/') norm++;
    if (!*norm || !strcmp(norm, ".")) {
        if (fstatat(root_fd, "", &st, AT_EMPTY_PATH) < 0) { send_errno(sid, errno, "stat", path); goto out; }
        put_fileinfo(&b, "/", "/", &st, -1, NULL);
    } else {
        int pfd = open_parent(path, base, sizeof base);
        if (pfd < 0) { send_errno(sid, errno, "stat", path); goto out; }
        if (fstatat(pfd, base, &st, AT_SYMLINK_NOFOLLOW) < 0) { send_errno(sid, errno, "stat", path); close(pfd); goto out; }
        put_fileinfo(&b, base, path, &st, pfd, base);
        close(pfd);
    }
    send_body(T_RESPONSE, sid, &b);
out:
    buf_free(&b);
    free(path);
}

static void h_read(uint64_t sid, mp_t body) {
    char *path = get_str(body, "path", NULL);
    int64_t off = get_int(body, "offset", 0), len = get_int(body, "length", -1);
    if (!path || body_err[0] || off < 0) { send_error(sid, "invalid_argument", "read: %s", body_err[0] ? body_err : "path missing or offset < 0"); free(path); return; }
    if (len < 0 || len > (int64_t)MAX_READ) len = MAX_READ;
    int fd = open_in_root(path, O_RDONLY | O_NONBLOCK, 0);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) < 0) { send_errno(sid, errno, "read", path); if (fd >= 0) close(fd); free(path); return; }
    if (!S_ISREG(st.st_mode)) { send_error(sid, "invalid_argument", "read %s: not a regular file", path); close(fd); free(path); return; }
    uint8_t *data = malloc(len ? len : 1);
    size_t got = 0;
    while ((int64_t)got < len) {
        ssize_t r = pread(fd, data + got, len - got, off + got);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) { send_errno(sid, errno, "read", path); goto out; }
        if (r == 0) break;
        got += r;
    }
    buf_t b = {0};
    int eof = (int64_t)(off + got) >= st.st_size;
    mp_map(&b, 3);
    mp_str(&b, "data"); mp_bin(&b, data, got);
    mp_str(&b, "size"); mp_int(&b, st.st_size);
    mp_str(&b, "eof"); mp_bool(&b, eof);
    send_body(T_RESPONSE, sid, &b);
    buf_free(&b);
out:
    free(data); close(fd); free(path);
}

static void h_write(uint64_t sid, mp_t body) {
    char *path = get_str(body, "path", NULL);
    size_t n; const uint8_t *data = get_bin(body, "data", &n);
    int64_t mode = get_int(body, "mode", 0644);
    int append = get_bool(body, "append", 0), parents = get_bool(body, "parents", 1);
    if (!path || body_err[0]) { send_error(sid, "invalid_argument", "write: %s", body_err[0] ? body_err : "path missing"); free(path); return; }
    if (parents) {
        char dir[PATH_MAX];
        snprintf(dir, sizeof dir, "%s", path);
        char *sl = strrchr(dir, '/');
        if (sl && sl != dir) { *sl = 0; if (mkdirs(dir, 0755) < 0) { send_errno(sid, errno, "write: creating the parents of", path); free(path); return; } }
    }
    int fd = open_in_root(path, O_WRONLY | O_CREAT | O_NONBLOCK | (append ? O_APPEND : O_TRUNC), (mode_t)(mode & 07777));
    if (fd < 0) { send_errno(sid, errno, "write", path); free(path); return; }
    struct stat st;
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) { send_error(sid, "invalid_argument", "write %s: not a regular file", path); close(fd); free(path); return; }
    size_t done = 0;
    while (done < n) {
        ssize_t w = write(fd, data + done, n - done);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) { send_errno(sid, errno, "write", path); close(fd); free(path); return; }
        done += w;
    }
    fstat(fd, &st);
    close(fd);
    buf_t b = {0};
    mp_map(&b, 1); mp_str(&b, "size"); mp_int(&b, st.st_size);
    send_body(T_RESPONSE, sid, &b);
    buf_free(&b); free(path);
}

static void h_list(uint64_t sid, mp_t body) {
    char *path = get_str(body, "path", NULL);
    int64_t limit = get_int(body, "limit", 10000);
    if (!path || body_err[0]) { send_error(sid, "invalid_argument", "list: %s", body_err[0] ? body_err : "path missing"); free(path); return; }
    int fd = open_in_root(path, O_RDONLY | O_DIRECTORY, 0);
    if (fd < 0) { send_errno(sid, errno, "list", path); free(path); return; }
    DIR *d = fdopendir(fd);
    buf_t b = {0};
    mp_map(&b, 2);
    mp_str(&b, "entries");
    size_t at = mp_arr32_placeholder(&b);
    uint32_t count = 0; int trunc = 0;
    struct dirent *de;
    size_t pl = strlen(path);
    while ((de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        if ((int64_t)count >= limit || b.len > MAX_FRAME - 64 * 1024) { trunc = 1; break; }
        struct stat st;
        if (fstatat(fd, de->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0) continue;
        char full[PATH_MAX + NAME_MAX + 2];
        snprintf(full, sizeof full, "%s%s%s", path, pl && path[pl - 1] == '/' ? "" : "/", de->d_name);
        put_fileinfo(&b, de->d_name, full, &st, fd, de->d_name);
        count++;
    }
    closedir(d);
    mp_arr32_patch(&b, at, count);
    mp_str(&b, "truncated"); mp_bool(&b, trunc);
    send_body(T_RESPONSE, sid, &b);
    buf_free(&b); free(path);
}

static void send_ok(uint64_t sid) {
    static const uint8_t ok[] = {0x81, 0xa2, 'o', 'k', 0xc3};
    send_frame(T_RESPONSE, sid, ok, sizeof ok, 0);
}

static void h_mkdir(uint64_t sid, mp_t body) {
    char *path = get_str(body, "path", NULL);
    int64_t mode = get_int(body, "mode", 0755);
    int parents = get_bool(body, "parents", 1);
    if (!path || body_err[0]) { send_error(sid, "invalid_argument", "mkdir: %s", body_err[0] ? body_err : "path missing"); free(path); return; }
    if (parents) {
        if (mkdirs(path, (mode_t)(mode & 07777)) < 0) send_errno(sid, errno, "mkdir", path);
        else send_ok(sid);
    } else {
        char base[NAME_MAX + 1];
        int pfd = open_parent(path, base, sizeof base);
        if (pfd < 0 || mkdirat(pfd, base, (mode_t)(mode & 07777)) < 0) send_errno(sid, errno, "mkdir", path);
        else send_ok(sid);
        if (pfd >= 0) close(pfd);
    }
    free(path);
}

static int rm_tree(int dfd, const char *name, int depth) {
    if (unlinkat(dfd, name, 0) == 0) return 0;
    if (errno != EISDIR && errno != EPERM) return -1;
    if (unlinkat(dfd, name, AT_REMOVEDIR) == 0) return 0;
    if (errno != ENOTEMPTY && errno != EEXIST) return -1;
    if (depth > 256) { errno = ELOOP; return -1; }
    int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return -1;
    DIR *d = fdopendir(fd);
    struct dirent *de;
    int r = 0;
    while ((de = readdir(d)))
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..") && rm_tree(fd, de->d_name, depth + 1) < 0) { r = -1; break; }
    int e = errno;
    closedir(d);
    if (r < 0) { errno = e; return -1; }
    return unlinkat(dfd, name, AT_REMOVEDIR);
}

static void h_remove(uint64_t sid, mp_t body) {
    char *path = get_str(body, "path", NULL);
    int rec = get_bool(body, "recursive", 0);
    if (!path || body_err[0]) { send_error(sid, "invalid_argument", "remove: %s", body_err[0] ? body_err : "path missing"); free(path); return; }
    char base[NAME_MAX + 1];
    int pfd = open_parent(path, base, sizeof base);
    int r = -1;
    if (pfd >= 0) {
        int dfd = openat(pfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (dfd >= 0) {
            if (rec) r = rm_tree(dfd, base, 0);
            else {
                r = unlinkat(dfd, base, 0);
                if (r < 0 && (errno == EISDIR || errno == EPERM)) r = unlinkat(dfd, base, AT_REMOVEDIR);
            }
            int e = errno; close(dfd); errno = e;
        }
        int e = errno; close(pfd); errno = e;
    }
    if (r < 0) send_errno(sid, errno, "remove", path);
    else send_ok(sid);
    free(path);
}

static void h_rename(uint64_t sid, mp_t body) {
    char *src = get_str(body, "src", NULL), *dst = get_str(body, "dst", NULL);
    if (!src || !dst || body_err[0]) { send_error(sid, "invalid_argument", "rename: %s", body_err[0] ? body_err : "src and dst needed"); goto out; }
    char b1[NAME_MAX + 1], b2[NAME_MAX + 1];
    int p1 = open_parent(src, b1, sizeof b1);
    if (p1 < 0) { send_errno(sid, errno, "rename", src); goto out; }
    int p2 = open_parent(dst, b2, sizeof b2);
    if (p2 < 0) { send_errno(sid, errno, "rename to", dst); close(p1); goto out; }
    int d1 = openat(p1, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC), d2 = openat(p2, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (d1 < 0 || d2 < 0 || renameat(d1, b1, d2, b2) < 0) send_errno(sid, errno, "rename", src);
    else send_ok(sid);
    if (d1 >= 0) close(d1);
    if (d2 >= 0) close(d2);
    close(p1); close(p2);
out:
    free(src); free(dst);
}

/* ---------------------------------------------------------------- setup */
static int write_file(const char *path, const char *val) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t w = write(fd, val, strlen(val));
    int e = errno;
    close(fd);
    if (w < 0) { errno = e; return -1; }
    return 0;
}
static int wait_path(const char *p, double secs) {
    double end = now_mono() + secs;
    while (access(p, F_OK) < 0) {
        if (now_mono() > end) return -1;
        usleep(5000);
    }
    return 0;
}
static void mk_dev(const char *name, mode_t mode, unsigned ma, unsigned mi) {
    char p[64];
    snprintf(p, sizeof p, SB "/dev/%s", name);
    mknod(p, S_IFCHR | mode, makedev(ma, mi));
    chmod(p, mode);
}

static void h_setup(uint64_t sid, mp_t body) {
    double t0 = now_mono();
    char err[512] = "";
    const char *code = "backend_error";
    size_t nl = 0, nenv = 0, ntun = 0;
    char **layers = get_strv(body, "layers", 0, &nl);
    char *scratch = get_str(body, "scratch", "");
    char *hostname = get_str(body, "hostname", "sandbox");
    int dax = get_bool(body, "dax", 0);
    char **env = get_strv(body, "env", 1, &nenv);
    char **tun = get_strv(body, "tunables", 1, &ntun);
    buf_t mounts = {0};
    uint32_t nm = 0;
    if (body_err[0]) { send_error(sid, "invalid_argument", "setup: %s", body_err); goto out; }
    if (setup_done) { send_error(sid, "conflict", "setup already ran in this guest (boot_id %s)", boot_id); goto out; }
    if (nl > 64) { send_error(sid, "invalid_argument", "setup: %zu layers, at most 64", nl); goto out; }
    for (size_t i = 0; i < ntun; i++) {
        char *eq = strchr(tun[i], '=');
        *eq = 0;
        if ((strncmp(tun[i], "/proc/sys/", 10) && strncmp(tun[i], "/sys/", 5)) || strstr(tun[i], "..")) {
            snprintf(err, sizeof err, "tunable %s: only paths under /proc/sys/ or /sys/", tun[i]); code = "invalid_argument"; goto fail;
        }
        if (write_file(tun[i], eq + 1) < 0) { snprintf(err, sizeof err, "tunable %s=%s: %s", tun[i], eq + 1, strerror(errno)); goto fail; }
        *eq = '=';
    }
    if (!test_mode) {
        if (modules_pid > 0) {      /* boot's module loading still running: wait for it */
            int st;
            while (waitpid(modules_pid, &st, 0) < 0 && errno == EINTR) {}
            modules_pid = 0;
        }
        mkdir("/layers", 0755);
        for (size_t i = 0; i < nl; i++) {
            char mp[64];
            snprintf(mp, sizeof mp, "/layers/%zu", i);
            mkdir(mp, 0755);
            if (wait_path(layers[i], 30) < 0) { snprintf(err, sizeof err, "layer device %s did not appear within 30 s (device probing under TCG on a loaded host took >5 s)", layers[i]); code = "not_found"; goto fail; }
            if (mount(layers[i], mp, "erofs", MS_RDONLY | MS_NODEV, dax ? "dax=always" : NULL) < 0) {
                snprintf(err, sizeof err, "mount erofs %s%s at %s: %s", layers[i], dax ? " (dax=always)" : "", mp, strerror(errno)); goto fail;
            }
            mp_str(&mounts, mp); nm++;
        }
        if (scratch[0]) {
            mkdir("/scratch", 0755);
            if (wait_path(scratch, 30) < 0) { snprintf(err, sizeof err, "scratch device %s did not appear within 30 s", scratch); code = "not_found"; goto fail; }
            if (mount(scratch, "/scratch", "ext4", MS_NOATIME, NULL) < 0) {
                snprintf(err, sizeof err, "mount ext4 %s at /scratch: %s (the host formats it with mkfs.ext4)", scratch, strerror(errno)); goto fail;
            }
            mp_str(&mounts, "/scratch"); nm++;
        } else {
            mkdir("/scratch", 0755);  /* no disk: changes live in the guest's RAM (rootfs) */
        }
        mkdir("/scratch/upper", 0755);
        mkdir("/scratch/work", 0755);
        mkdir(SB, 0755);
        if (nl == 0) {
            if (mount("/scratch/upper", SB, NULL, MS_BIND, NULL) < 0) { snprintf(err, sizeof err, "bind /scratch/upper at /sb: %s", strerror(errno)); goto fail; }
        } else {
            buf_t o = {0};
            buf_put(&o, "lowerdir=", 9);
            for (size_t i = nl; i-- > 0;) {
                char mp[64];
                int k = snprintf(mp, sizeof mp, "%s/layers/%zu", i + 1 < nl ? ":" : "", i);
                buf_put(&o, mp, k);
            }
            /* the flags the container backend uses (dsec.image.compose.OVERLAY_FLAGS):
             * directory renames are neither written as redirects nor followed, so the
             * upper dir is plain overlay encoding that pack_diff understands */
            const char *rest = ",upperdir=/scratch/upper,workdir=/scratch/work,redirect_dir=nofollow,metacopy=off";
            buf_put(&o, rest, strlen(rest) + 1);
            int r = mount("overlay", SB, "overlay", 0, (char *)o.p);
            if (r < 0) snprintf(err, sizeof err, "mount overlay at /sb (%s): %s", (char *)o.p, strerror(errno));
            buf_free(&o);
            if (r < 0) goto fail;
        }
        mp_str(&mounts, SB); nm++;
        mkdir(SB "/proc", 0555); mkdir(SB "/sys", 0555); mkdir(SB "/dev", 0755); mkdir(SB "/tmp", 01777);
        if (mount("proc", SB "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0) { snprintf(err, sizeof err, "mount /sb/proc: %s", strerror(errno)); goto fail; }
        if (mount("sysfs", SB "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, NULL) < 0) { snprintf(err, sizeof err, "mount /sb/sys: %s", strerror(errno)); goto fail; }
        if (mount("tmpfs", SB "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=1m") < 0) { snprintf(err, sizeof err, "mount /sb/dev: %s", strerror(errno)); goto fail; }
        mk_dev("null", 0666, 1, 3); mk_dev("zero", 0666, 1, 5); mk_dev("full", 0666, 1, 7);
        mk_dev("random", 0666, 1, 8); mk_dev("urandom", 0666, 1, 9); mk_dev("tty", 0666, 5, 0);
        mkdir(SB "/dev/pts", 0755); mkdir(SB "/dev/shm", 01777);
        mount("devpts", SB "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620");
        symlink("pts/ptmx", SB "/dev/ptmx");
        symlink("/proc/self/fd", SB "/dev/fd");
        symlink("/proc/self/fd/0", SB "/dev/stdin"); symlink("/proc/self/fd/1", SB "/dev/stdout"); symlink("/proc/self/fd/2", SB "/dev/stderr");
        /* only when needed: a chmod copies /tmp up into the upper dir, and every
         * snapshot of an unchanged sandbox would then differ from the one it came from */
        struct stat tmp_st;
        if (stat(SB "/tmp", &tmp_st) != 0 || (tmp_st.st_mode & 07777) != 01777) chmod(SB "/tmp", 01777);
        sethostname(hostname, strlen(hostname));
        mp_str(&mounts, SB "/proc"); mp_str(&mounts, SB "/sys"); mp_str(&mounts, SB "/dev"); nm += 3;
    }
    root_fd = open(sb_path, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (root_fd < 0) { snprintf(err, sizeof err, "open %s: %s", sb_path, strerror(errno)); goto fail; }
    free_strv(base_env);
    base_env = env; base_env_n = nenv; env = NULL;
    setup_done = 1;
    {
        buf_t b = {0};
        mp_map(&b, 2);
        mp_str(&b, "duration_s"); mp_float(&b, now_mono() - t0);
        mp_str(&b, "mounts"); mp_arr(&b, nm); buf_put(&b, mounts.p, mounts.len);
        send_body(T_RESPONSE, sid, &b);
        buf_free(&b);
    }
    goto out;
fail:
    logf_("setup failed: %s", err);
    send_error(sid, code, "setup: %s", err);
out:
    buf_free(&mounts);
    free_strv(layers); free_strv(env); free_strv(tun); free(scratch); free(hostname);
}

/* ---------------------------------------------------------------- exec */
static job_t *job_new(void) {
    for (int i = 0; i < MAX_EXECS; i++) if (!jobs[i].used) {
        memset(&jobs[i], 0, sizeof jobs[i]);
        jobs[i].used = 1;
        jobs[i].out_fd = jobs[i].err_fd = jobs[i].in_fd = jobs[i].cnt_fd = -1;
        return &jobs[i];
    }
    return NULL;
}
static void job_free(job_t *j) {
    if (j->out_fd >= 0) close(j->out_fd);
    if (j->err_fd >= 0) close(j->err_fd);
    if (j->in_fd >= 0) close(j->in_fd);
    if (j->cnt_fd >= 0) close(j->cnt_fd);
    buf_free(&j->out); buf_free(&j->err); buf_free(&j->in);
    j->used = 0;
}

/* resolve user ("", "root", "1000", "name", "uid:gid", "name:gid") via /sb/etc/passwd */
static int resolve_user(const char *user, uid_t *uid, gid_t *gid, char *home, size_t hsz) {
    *uid = 0; *gid = 0; snprintf(home, hsz, "/root");
    if (!user || !*user || !strcmp(user, "root")) return 0;
    char name[256]; const char *colon = strchr(user, ':');
    size_t nl = colon ? (size_t)(colon - user) : strlen(user);
    if (nl >= sizeof name) return -1;
    memcpy(name, user, nl); name[nl] = 0;
    int numeric = nl > 0 && strspn(name, "0123456789") == nl;
    int found = 0;
    if (numeric) { *uid = (uid_t)strtoul(name, NULL, 10); *gid = *uid; snprintf(home, hsz, "/"); }
    int fd = open_in_root("/etc/passwd", O_RDONLY | O_NONBLOCK, 0);
    if (fd >= 0) {
        struct stat st;
        if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size < (1 << 20)) {
            FILE *f = fdopen(fd, "re");
            char line[1024];
            while (f && fgets(line, sizeof line, f)) {
                char *fl[7] = {0}; char *s = line; int k = 0;
                for (; k < 7; k++) { fl[k] = strsep(&s, ":"); if (!fl[k]) break; }
                if (k < 6) continue;
                char *nlc = strchr(fl[5], '\n'); if (nlc) *nlc = 0;
                if ((!numeric && !strcmp(fl[0], name)) || (numeric && (uid_t)strtoul(fl[2], NULL, 10) == *uid)) {
                    *uid = (uid_t)strtoul(fl[2], NULL, 10); *gid = (gid_t)strtoul(fl[3], NULL, 10);
                    snprintf(home, hsz, "%s", fl[5]); found = 1; break;
                }
            }
            if (f) fclose(f); else close(fd);
        } else close(fd);
    }
    if (!numeric && !found) return -1;
    if (colon && colon[1]) *gid = (gid_t)strtoul(colon + 1, NULL, 10);
    return 0;
}

static int set_nb(int fd) { return fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

static void h_exec(uint64_t sid, mp_t body, int streaming) {
    size_t argc = 0, envc = 0, stdin_n = 0;
    char **argv = get_strv(body, "argv", 0, &argc);
    char **env = get_strv(body, "env", 1, &envc);
    char *shell = get_str(body, "shell", NULL), *cwd = get_str(body, "cwd", NULL), *user = get_str(body, "user", NULL);
    const uint8_t *stdin_d = get_bin(body, "stdin", &stdin_n);
    int nil_to = 0;
    double to = get_float(body, "timeout_s", 60.0, &nil_to);
    int64_t cap = get_int(body, "output_cap_bytes", 1 << 20);
    int bg = get_bool(body, "background", 0);
    mp_t v;
    job_t *j = NULL;
    int pin[2] = {-1, -1}, pout[2] = {-1, -1}, perr[2] = {-1, -1}, pst[2] = {-1, -1};
    if (body_err[0]) { send_error(sid, "invalid_argument", "exec: %s", body_err); goto out; }
    if (mp_get(body, "hide", &v) == 1 && *v.p != 0x90 && *v.p != 0xc0) { send_error(sid, "invalid_argument", "exec: hide needs the container backend's native runtime; the vm tier does not support it"); goto out; }
    if ((mp_get(body, "pty", &v) == 1 && *v.p != 0xc0) || get_bool(body, "stdin_open", 0)) { send_error(sid, "invalid_argument", "exec: pty and stdin_open (processes) are not supported by the vm tier's agent"); goto out; }
    if ((argc == 0) == (shell == NULL)) { send_error(sid, "invalid_argument", "exec: give exactly one of argv and shell"); goto out; }
    if (!setup_done) { send_error(sid, "conflict", "exec before setup: call setup first"); goto out; }
    if (cap < 0) cap = 0;
    if (!streaming && cap > (int64_t)MAX_EXEC_OUTPUT) cap = MAX_EXEC_OUTPUT;  /* use exec_stream for more */
    uid_t uid; gid_t gid; char home[512];
    if (resolve_user(user, &uid, &gid, home, sizeof home) < 0) {
        buf_t b = {0};
        mp_map(&b, 3);
        mp_str(&b, "code"); mp_str(&b, "cannot_run");
        mp_str(&b, "message"); char m[400]; snprintf(m, sizeof m, "exec could not start: unknown user %.64s in the sandbox's /etc/passwd", user); mp_str(&b, m);
        mp_str(&b, "detail"); mp_map(&b, 1); mp_str(&b, "exit_code"); mp_int(&b, 126);
        send_body(T_ERROR, sid, &b); buf_free(&b);
        goto out;
    }
    j = job_new();
    if (!j) { send_error(sid, "resource_exhausted", "exec: %d commands already running in the guest", MAX_EXECS); goto out; }
    if (pipe2(pst, O_CLOEXEC) < 0 || (!bg && (pipe2(pout, O_CLOEXEC) < 0 || pipe2(perr, O_CLOEXEC) < 0)) || (stdin_n && !bg && pipe2(pin, O_CLOEXEC) < 0)) {
        send_errno(sid, errno, "exec: pipe", ""); goto fail;
    }
    /* envp: PATH/HOME defaults, then setup env, then the request's */
    size_t en = 0;
    char **envp = calloc(base_env_n + envc + 8, sizeof *envp);
    /* defaults as the container backend's (container/rootfs.py DEFAULT_ENV + HOSTNAME) */
    char pathv[] = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
    char homev[600]; snprintf(homev, sizeof homev, "HOME=%s", home);
    char hostv[80] = "HOSTNAME="; gethostname(hostv + 9, sizeof hostv - 10);
    char *defs[] = {pathv, homev, "TERM=xterm", "LANG=C.UTF-8", hostv};
    for (int d = 0; d < 5; d++) envp[en++] = defs[d];
    char **srcs[2] = {base_env, env};
    for (int s = 0; s < 2; s++) for (size_t i = 0; srcs[s] && srcs[s][i]; i++) {
        size_t kl = strchr(srcs[s][i], '=') - srcs[s][i];
        size_t k;
        for (k = 0; k < en; k++) if (!strncmp(envp[k], srcs[s][i], kl + 1)) { envp[k] = srcs[s][i]; break; }
        if (k == en) envp[en++] = srcs[s][i];
    }
    envp[en] = NULL;
    char *shv[] = {"/bin/sh", "-c", shell, NULL};
    char **av = shell ? shv : argv;
    long oom0 = read_vmstat("oom_kill");
    pid_t pid = fork();
    if (pid < 0) { int e = errno; free(envp); send_errno(sid, e, "exec: fork", ""); goto fail; }
    if (pid == 0) {
        sigset_t all; sigemptyset(&all); sigprocmask(SIG_SETMASK, &all, NULL);
        signal(SIGPIPE, SIG_DFL);
        setsid();
        int stage = 0;
        int nul = open("/dev/null", O_RDWR);
        if (!test_mode && chroot(SB) < 0) goto child_fail;
        if (test_mode && chdir(sb_path) < 0) goto child_fail;
        dup2(pin[0] >= 0 ? pin[0] : nul, 0);
        dup2(pout[1] >= 0 ? pout[1] : nul, 1);
        dup2(perr[1] >= 0 ? perr[1] : nul, 2);
        stage = 1;
        if (cwd) { if (chdir(cwd) < 0) goto child_fail; }
        else if (!test_mode && chdir(uid ? home : "/") < 0 && chdir("/") < 0) goto child_fail;
        stage = 2;
        if (uid || gid) {
            if (setgroups(0, NULL) < 0 || setgid(gid) < 0 || setuid(uid) < 0) goto child_fail;
        }
        stage = 3;
        environ = envp;               /* execvp searches the PATH of the new environment */
        execvp(av[0], av);
    child_fail:;
        int msg[2] = {stage, errno};
        ssize_t w = write(pst[1], msg, sizeof msg); (void)w;
        _exit(127);
    }
    free(envp);
    close(pst[1]); pst[1] = -1;
    int msg[2] = {0, 0};
    ssize_t r;
    do r = read(pst[0], msg, sizeof msg); while (r < 0 && errno == EINTR);
    close(pst[0]); pst[0] = -1;
    if (r == sizeof msg) {
        int e = msg[1];
        static const char *stages[] = {"entering the sandbox root", "changing to the working directory", "switching user", "running"};
        /* the child failed before the program ran: exec error (it exits 127, reaped later) */
        j->used = 1; j->pid = pid; j->sid = 0; j->kind = 3; j->exited = 0;
        buf_t b = {0};
        mp_map(&b, 3);
        mp_str(&b, "code"); mp_str(&b, "cannot_run");
        char m[700]; snprintf(m, sizeof m, "exec could not start %.200s: %s failed: %s%s%.200s", av[0], stages[msg[0] & 3], strerror(e), msg[0] == 1 ? " ; cwd " : "", msg[0] == 1 && cwd ? cwd : "");
        mp_str(&b, "message"); mp_str(&b, m);
        mp_str(&b, "detail"); mp_map(&b, 1); mp_str(&b, "exit_code"); mp_int(&b, e == ENOENT && msg[0] == 3 ? 127 : 126);
        send_body(T_ERROR, sid, &b); buf_free(&b);
        for (int k = 0; k < 2; k++) { int *pp = k ? pout : perr; if (pp[0] >= 0) close(pp[0]); if (pp[1] >= 0) close(pp[1]); }
        if (pin[0] >= 0) close(pin[0]);
        if (pin[1] >= 0) close(pin[1]);
        goto out;
    }
    j->pid = pid; j->start = now_mono(); j->cap = cap; j->oom_before = (int)oom0;
    if (bg) {
        j->kind = 3; j->sid = 0;
        buf_t b = {0};
        mp_map(&b, 2); mp_str(&b, "exit_code"); mp_int(&b, 0); mp_str(&b, "pid"); mp_int(&b, pid);
        send_body(T_RESPONSE, sid, &b); buf_free(&b);
        goto out;
    }
    j->kind = streaming ? 1 : 0; j->sid = sid; j->credit = initial_credit();
    j->deadline = (nil_to || to <= 0) ? 0 : j->start + to;
    close(pout[1]); close(perr[1]);
    j->out_fd = pout[0]; j->err_fd = perr[0]; set_nb(j->out_fd); set_nb(j->err_fd);
    if (pin[0] >= 0) {
        close(pin[0]);
        j->in_fd = pin[1]; set_nb(j->in_fd);
        buf_put(&j->in, stdin_d, stdin_n);
    }
    goto out;
fail:
    if (j) job_free(j);
    for (int k = 0; k < 2; k++) { int *pp = k ? pout : perr; if (pp[0] >= 0) close(pp[0]); if (pp[1] >= 0) close(pp[1]); }
    if (pin[0] >= 0) close(pin[0]);
    if (pin[1] >= 0) close(pin[1]);
    if (pst[0] >= 0) close(pst[0]);
    if (pst[1] >= 0) close(pst[1]);
out:
    free_strv(argv); free_strv(env); free(shell); free(cwd); free(user);
}

/* the job's caller is gone (CANCEL, disconnect, new connection): nobody can receive its
 * result, so a foreground command's process group (or the diff writer) is killed and
 * whatever it still prints is discarded; background commands are not affected */
static void job_abandon(job_t *j) {
    if (!j->used || j->sid == 0) return;
    j->sid = 0;
    if (j->pid > 0 && !j->exited) { kill(-j->pid, SIGKILL); kill(j->pid, SIGKILL); }
}

static void job_finish(job_t *j) {
    if (j->kind == 3 || j->sid == 0) { job_free(j); return; }
    buf_t b = {0};
    if (j->kind == 2) {
        if (!(WIFEXITED(j->status) && WEXITSTATUS(j->status) == 0)) {
            send_error(j->sid, "backend_error", "diff: the tar writer failed (status %d)", j->status);
        } else {
            mp_map(&b, 3);
            mp_str(&b, "bytes"); mp_int(&b, (int64_t)j->streamed);
            mp_str(&b, "entries"); mp_int(&b, (int64_t)j->counts[0]);
            mp_str(&b, "skipped"); mp_int(&b, (int64_t)j->counts[1]);
            send_body(T_RESPONSE, j->sid, &b);
        }
        buf_free(&b); job_free(j); return;
    }
    int code = WIFEXITED(j->status) ? WEXITSTATUS(j->status) : 128 + WTERMSIG(j->status);
    int oom = WIFSIGNALED(j->status) && WTERMSIG(j->status) == SIGKILL && !j->timed_out && read_vmstat("oom_kill") > j->oom_before;
    int n = 2 + (j->kind == 0 ? 2 : 0) + j->out_trunc + j->err_trunc + j->timed_out + oom;
    mp_map(&b, n);
    mp_str(&b, "exit_code"); mp_int(&b, code);
    if (j->kind == 0) {
        mp_str(&b, "stdout"); mp_bin(&b, j->out.p, j->out.len);
        mp_str(&b, "stderr"); mp_bin(&b, j->err.p, j->err.len);
    }
    if (j->out_trunc) { mp_str(&b, "stdout_truncated"); mp_bool(&b, 1); }
    if (j->err_trunc) { mp_str(&b, "stderr_truncated"); mp_bool(&b, 1); }
    if (j->timed_out) { mp_str(&b, "timed_out"); mp_bool(&b, 1); }
    if (oom) { mp_str(&b, "oom_killed"); mp_bool(&b, 1); }
    mp_str(&b, "duration_s"); mp_float(&b, now_mono() - j->start);
    send_body(T_RESPONSE, j->sid, &b);
    buf_free(&b);
    job_free(j);
}

/* read what a job's pipe has; returns 1 on EOF/error (fd closed) */
static int job_pump(job_t *j, int which) {
    int *fd = which ? &j->err_fd : &j->out_fd;
    uint8_t tmp[65536];
    for (int rounds = 0; rounds < 16; rounds++) {
        ssize_t r = read(*fd, tmp, sizeof tmp);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && errno == EAGAIN) return 0;
        if (r <= 0) { close(*fd); *fd = -1; return 1; }
        if (j->sid == 0) continue;   /* abandoned: drain and drop */
        if (j->kind == 2) {          /* diff: tar bytes */
            if (which == 0) {
                buf_t b = {0};
                mp_map(&b, 1); mp_str(&b, "data"); mp_bin(&b, tmp, r);
                send_frame(T_STREAM, j->sid, b.p, b.len, 0);
                j->credit -= (int64_t)b.len;
                buf_free(&b);
                j->streamed += r;
                if (j->credit <= 0) return 0;
            } else {                  /* counts from the writer: "entries skipped\n" */
                buf_put(&j->err, tmp, r);
                buf_u8(&j->err, 0); j->err.len--;
                unsigned long long a = 0, c = 0;
                if (sscanf((char *)j->err.p, "%llu %llu", &a, &c) == 2) { j->counts[0] = a; j->counts[1] = c; }
            }
            if (outb.len > OUT_HIGH) return 0;
            continue;
        }
        buf_t *acc = which ? &j->err : &j->out;
        int *trunc = which ? &j->err_trunc : &j->out_trunc;
        size_t have = j->kind == 1 ? j->cnt[which] : acc->len;
        size_t room = (size_t)j->cap > have ? (size_t)j->cap - have : 0;
        size_t keep = (size_t)r < room ? (size_t)r : room;
        if (keep < (size_t)r) *trunc = 1;
        if (j->kind == 1) {
            if (keep) {
                buf_t b = {0};
                mp_map(&b, 2);
                mp_str(&b, "stream"); mp_str(&b, which ? "stderr" : "stdout");
                mp_str(&b, "data"); mp_bin(&b, tmp, keep);
                send_frame(T_STREAM, j->sid, b.p, b.len, 0);
                j->credit -= (int64_t)b.len;
                buf_free(&b);
            }
            j->cnt[which] += keep;
            if (j->credit <= 0) return 0;
        } else if (keep) buf_put(acc, tmp, keep);
        if (outb.len > OUT_HIGH) return 0;
    }
    return 0;
}

static void h_signal(uint64_t sid, mp_t body) {
    int64_t pid = get_int(body, "pid", 0), sig = get_int(body, "sig", 15);
    int grp = get_bool(body, "group", 1);
    if (body_err[0] || pid <= 1 || pid > INT_MAX || sig < 0 || sig > 64) { send_error(sid, "invalid_argument", "signal: pid must be > 1 and sig 0..64 (%s)", body_err); return; }
    if (kill(grp ? -(pid_t)pid : (pid_t)pid, (int)sig) < 0) {
        if (grp && errno == ESRCH && kill((pid_t)pid, (int)sig) == 0) { send_ok(sid); return; }
        send_errno(sid, errno, "signal", "");
        return;
    }
    send_ok(sid);
}

/* ---------------------------------------------------------------- diff (tar writer, in a child) */
typedef struct { int fd; uint64_t entries, skipped; } tarw_t;
static void tw_write(tarw_t *t, const void *p, size_t n) {
    const uint8_t *b = p;
    while (n) {
        ssize_t w = write(t->fd, b, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) _exit(3);
        b += w; n -= w;
    }
}
static void oct(char *dst, size_t n, uint64_t v) {
    /* n-1 octal digits and a NUL; values that do not fit are clamped (sizes that large
     * get a pax "size" record instead) */
    uint64_t max = (1ULL << (3 * (n - 1))) - 1;
    char t[32];
    snprintf(t, sizeof t, "%0*llo", (int)n - 1, (unsigned long long)(v > max ? max : v));
    memcpy(dst, t, n);
}
static void tw_header(tarw_t *t, const char *name, char type, uint64_t size, const struct stat *st, const char *link, unsigned ma, unsigned mi) {
    char h[512];
    memset(h, 0, sizeof h);
    snprintf(h, 100, "%s", name);
    oct(h + 100, 8, st ? st->st_mode & 07777 : 0644);
    oct(h + 108, 8, st ? st->st_uid : 0);
    oct(h + 116, 8, st ? st->st_gid : 0);
    oct(h + 124, 12, size);
    oct(h + 136, 12, st && st->st_mtime > 0 ? (uint64_t)st->st_mtime : 0);
    memset(h + 148, ' ', 8);
    h[156] = type;
    if (link) snprintf(h + 157, 100, "%s", link);
    memcpy(h + 257, "ustar", 6);
    memcpy(h + 263, "00", 2);
    oct(h + 329, 8, ma);
    oct(h + 337, 8, mi);
    unsigned sum = 0;
    for (int i = 0; i < 512; i++) sum += (uint8_t)h[i];
    snprintf(h + 148, 8, "%06o", sum);
    h[155] = ' ';
    tw_write(t, h, 512);
}
static void pax_rec(buf_t *b, const char *k, const char *v, size_t vl) {
    size_t base = strlen(k) + vl + 3;   /* ' ' '=' '\n' */
    size_t len = base + 1;
    for (;;) { char d[24]; size_t L = base + snprintf(d, sizeof d, "%zu", len); if (L == len) break; len = L; }
    char d[24]; int dl = snprintf(d, sizeof d, "%zu ", len);
    buf_put(b, d, dl); buf_put(b, k, strlen(k)); buf_u8(b, '='); buf_put(b, v, vl); buf_u8(b, '\n');
}
static void tw_pad(tarw_t *t, uint64_t n) {
    static const char z[512];
    if (n % 512) tw_write(t, z, 512 - n % 512);
}
static void tw_entry(tarw_t *t, int dfd, const char *name, const char *rel, int depth) {
    struct stat st;
    if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) < 0) { t->skipped++; return; }
    char link[PATH_MAX] = "";
    char type;
    int opaque = 0;
    if (S_ISREG(st.st_mode)) type = '0';
    else if (S_ISDIR(st.st_mode)) {
        type = '5';
        char v[8];
        int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (fd >= 0) {
            ssize_t n = fgetxattr(fd, "trusted.overlay.opaque", v, sizeof v);
            opaque = n == 1 && v[0] == 'y';
            close(fd);
        }
    } else if (S_ISLNK(st.st_mode)) {
        type = '2';
        ssize_t n = readlinkat(dfd, name, link, sizeof link - 1);
        if (n < 0) { t->skipped++; return; }
        link[n] = 0;
    } else if (S_ISCHR(st.st_mode) && st.st_rdev == 0) type = '3';
    else { t->skipped++; return; }
    size_t rl = strlen(rel);
    buf_t pax = {0};
    if (rl >= 100) pax_rec(&pax, "path", rel, rl);
    if (strlen(link) >= 100) pax_rec(&pax, "linkpath", link, strlen(link));
    if (opaque) pax_rec(&pax, "SCHILY.xattr.trusted.overlay.opaque", "y", 1);
    if (type == '0' && (uint64_t)st.st_size >= 077777777777ULL) {
        char s[32]; int n = snprintf(s, sizeof s, "%lld", (long long)st.st_size); pax_rec(&pax, "size", s, n);
    }
    if (pax.len) {
        tw_header(t, "././@PaxHeader", 'x', pax.len, NULL, NULL, 0, 0);
        tw_write(t, pax.p, pax.len);
        tw_pad(t, pax.len);
    }
    buf_free(&pax);
    uint64_t size = type == '0' ? (uint64_t)st.st_size : 0;
    tw_header(t, rel, type, size >= 077777777777ULL ? 0 : size, &st, type == '2' ? link : NULL, 0, 0);
    t->entries++;
    if (type == '0') {
        int fd = openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
        uint64_t left = size;
        static uint8_t blk[1 << 16];
        while (fd >= 0 && left) {
            ssize_t r = read(fd, blk, left < sizeof blk ? left : sizeof blk);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) break;
            tw_write(t, blk, r); left -= r;
        }
        if (left) { memset(blk, 0, sizeof blk); while (left) { size_t k = left < sizeof blk ? left : sizeof blk; tw_write(t, blk, k); left -= k; } }  /* file shrank: pad */
        if (fd >= 0) close(fd);
        tw_pad(t, size);
    } else if (type == '5') {
        if (depth > 512) return;
        int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0) return;
        DIR *d = fdopendir(fd);
        struct dirent *de;
        while ((de = readdir(d))) {
            if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
            char sub[PATH_MAX];
            if (snprintf(sub, sizeof sub, "%s/%s", rel, de->d_name) >= (int)sizeof sub) { t->skipped++; continue; }
            tw_entry(t, fd, de->d_name, sub, depth + 1);
        }
        closedir(d);
    }
}
static void diff_child(int out, int cnt) {
    tarw_t t = {out, 0, 0};
    const char *upper = test_mode ? sb_path : "/scratch/upper";
    int fd = open(upper, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) _exit(2);
    DIR *d = fdopendir(fd);
    struct dirent *de;
    while ((de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        tw_entry(&t, fd, de->d_name, de->d_name, 0);
    }
    static const char z[1024];
    tw_write(&t, z, 1024);
    char s[64]; int n = snprintf(s, sizeof s, "%llu %llu\n", (unsigned long long)t.entries, (unsigned long long)t.skipped);
    ssize_t w = write(cnt, s, n); (void)w;
    _exit(0);
}
static void h_diff(uint64_t sid, int streaming) {
    if (!streaming) { send_error(sid, "invalid_argument", "diff is a streaming method: call it with the STREAMING flag"); return; }
    if (!setup_done) { send_error(sid, "conflict", "diff before setup"); return; }
    job_t *j = job_new();
    if (!j) { send_error(sid, "resource_exhausted", "diff: too many jobs"); return; }
    int po[2], pc[2];
    if (pipe2(po, O_CLOEXEC) < 0) { job_free(j); send_errno(sid, errno, "diff: pipe", ""); return; }
    if (pipe2(pc, O_CLOEXEC) < 0) { close(po[0]); close(po[1]); job_free(j); send_errno(sid, errno, "diff: pipe", ""); return; }
    pid_t pid = fork();
    if (pid == 0) { close(po[0]); close(pc[0]); diff_child(po[1], pc[1]); }
    close(po[1]); close(pc[1]);
    if (pid < 0) { close(po[0]); close(pc[0]); job_free(j); send_errno(sid, errno, "diff: fork", ""); return; }
    j->kind = 2; j->sid = sid; j->pid = pid; j->credit = initial_credit(); j->start = now_mono(); j->cap = INT64_MAX;
    j->out_fd = po[0]; j->err_fd = pc[0]; set_nb(po[0]); set_nb(pc[0]);
}

/* ---------------------------------------------------------------- hello, stats, quiesce */
static void put_devices(buf_t *b);
static void h_hello(uint64_t sid) {
    struct utsname u; uname(&u);
    buf_t b = {0};
    mp_map(&b, 10);
    mp_str(&b, "version"); mp_int(&b, PROTO_VERSION);
    mp_str(&b, "kernel"); mp_str(&b, u.release);
    mp_str(&b, "mem_total"); mp_int(&b, meminfo("MemTotal"));
    mp_str(&b, "boot_id"); mp_str(&b, boot_id);
    mp_str(&b, "uptime_s"); mp_float(&b, now_mono() - t_boot);
    mp_str(&b, "setup_done"); mp_bool(&b, setup_done);
    mp_str(&b, "connections"); mp_int(&b, connections);
    put_devices(&b);
    send_body(T_RESPONSE, sid, &b);
    buf_free(&b);
}
static void h_stats(uint64_t sid) {
    buf_t b = {0};
    uint64_t cpu = 0;
    FILE *f = fopen("/proc/stat", "re");
    if (f) {
        unsigned long long v[10] = {0};
        if (fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6], &v[7]) == 8)
            cpu = (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) * (1000000000ULL / (uint64_t)sysconf(_SC_CLK_TCK));
        fclose(f);
    }
    int pids = 0;
    DIR *d = opendir("/proc");
    struct dirent *de;
    while (d && (de = readdir(d))) {
        if (de->d_name[0] < '1' || de->d_name[0] > '9') continue;
        if (atoi(de->d_name) == getpid()) continue;
        char p[64], line[256]; snprintf(p, sizeof p, "/proc/%s/stat", de->d_name);
        FILE *s = fopen(p, "re");
        if (!s) continue;
        if (fgets(line, sizeof line, s)) {
            char *rp = strrchr(line, ')');
            int ppid = 0; char st;
            if (rp && sscanf(rp + 2, "%c %d", &st, &ppid) == 2 && ppid != 2 && ppid != 0) pids++;
        }
        fclose(s);
    }
    if (d) closedir(d);
    struct statfs sf;
    uint64_t used = 0, total = 0;
    if (statfs(test_mode ? sb_path : "/scratch", &sf) == 0) { total = (uint64_t)sf.f_blocks * sf.f_bsize; used = (uint64_t)(sf.f_blocks - sf.f_bfree) * sf.f_bsize; }
    mp_map(&b, 7);
    mp_str(&b, "mem_total"); mp_int(&b, meminfo("MemTotal"));
    mp_str(&b, "mem_available"); mp_int(&b, meminfo("MemAvailable"));
    mp_str(&b, "cpu_ns"); mp_int(&b, (int64_t)cpu);
    mp_str(&b, "pids"); mp_int(&b, pids);
    mp_str(&b, "disk_used"); mp_int(&b, (int64_t)used);
    mp_str(&b, "disk_total"); mp_int(&b, (int64_t)total);
    mp_str(&b, "oom_kills"); mp_int(&b, read_vmstat("oom_kill"));
    send_body(T_RESPONSE, sid, &b);
    buf_free(&b);
}
/* ---------------------------------------------------------------- devices
 * A memory file saved before boot's module loader finished holds virtio devices no
 * driver had touched yet; QEMU 7.2 restores such a device so that the probe after the
 * restore fails (measured, warm-pool clones at load ~12: "virtio_pmem virtio1: virtio:
 * device uses modern interface but does not have VIRTIO_F_VERSION_1", "probe with
 * driver virtio_pmem failed with error -22", no /dev/pmem0; virtio-blk, being
 * transitional, fell back to the legacy interface and worked). So hello and quiesce
 * report what the guest has (block devices, virtio devices without a driver, whether
 * the loader still runs), and quiesce can wait until everything is probed: the host
 * saves a warm-pool template only when it says so, and refuses a clone that lacks a
 * device (it boots cold instead). */
static int loader_running(void) {
    if (modules_pid > 0) {
        int st;
        pid_t r = waitpid(modules_pid, &st, WNOHANG);
        if (r == modules_pid || (r < 0 && errno == ECHILD)) modules_pid = 0;
    }
    return modules_pid > 0;
}
/* virtio devices with no driver bound (not probed yet, or their probe failed): counted,
 * and listed as "virtioN:<device id>" into b when b is not NULL */
static uint32_t virtio_unbound(buf_t *b) {
    uint32_t n = 0;
    DIR *d = test_mode ? NULL : opendir("/sys/bus/virtio/devices");
    if (!d) return 0;
    struct dirent *de;
    while ((de = readdir(d)) && n < 64) {
        if (de->d_name[0] == '.' || strlen(de->d_name) > 200) continue;
        char p[320], v[32] = {0};
        snprintf(p, sizeof p, "/sys/bus/virtio/devices/%s/driver", de->d_name);
        if (access(p, F_OK) == 0) continue;
        n++;
        if (!b) continue;
        snprintf(p, sizeof p, "/sys/bus/virtio/devices/%s/device", de->d_name);
        FILE *f = fopen(p, "re");
        if (f) { if (!fgets(v, sizeof v, f)) v[0] = 0; fclose(f); }
        v[strcspn(v, "\n")] = 0;
        char item[280];
        snprintf(item, sizeof item, "%s:%ld", de->d_name, strtol(v, NULL, 0));
        mp_str(b, item);
    }
    closedir(d);
    return n;
}
/* the keys devices/unbound/probing (3 map entries) */
static void put_devices(buf_t *b) {
    mp_str(b, "devices");
    size_t at = mp_arr32_placeholder(b);
    uint32_t n = 0;
    DIR *d = test_mode ? NULL : opendir("/sys/block");
    if (d) {
        struct dirent *de;
        while ((de = readdir(d)) && n < 256) {
            if (de->d_name[0] == '.') continue;
            mp_str(b, de->d_name); n++;
        }
        closedir(d);
    }
    mp_arr32_patch(b, at, n);
    mp_str(b, "unbound");
    at = mp_arr32_placeholder(b);
    mp_arr32_patch(b, at, virtio_unbound(b));
    mp_str(b, "probing"); mp_bool(b, loader_running());
}
/* a block device name the host may ask for: [a-z0-9], 1..31 characters */
static int dev_name_ok(const char *s) {
    size_t n = strlen(s);
    return n > 0 && n < 32 && strspn(s, "abcdefghijklmnopqrstuvwxyz0123456789") == n;
}
/* wait (at most secs) until boot's module loader ended, every virtio device has a
 * driver and /dev/<want[i]> exists for each i; 1 when all hold */
static int settle(char **want, size_t nwant, double secs) {
    double end = now_mono() + secs;
    for (;;) {
        int ok = test_mode || (!loader_running() && virtio_unbound(NULL) == 0);
        for (size_t i = 0; ok && !test_mode && i < nwant; i++) {
            char p[64];
            snprintf(p, sizeof p, "/dev/%s", want[i]);
            if (access(p, F_OK) < 0) ok = 0;
        }
        if (ok) return 1;
        if (now_mono() >= end) return 0;
        usleep(5000);
    }
}

static void h_quiesce(uint64_t sid, mp_t body) {
    double t0 = now_mono();
    int drop = get_bool(body, "drop_caches", 1), compact = get_bool(body, "compact", 1);
    size_t nwant = 0;
    char **want = get_strv(body, "devices", 0, &nwant);
    double secs = get_float(body, "settle_s", 0.0, NULL);
    if (body_err[0]) { send_error(sid, "invalid_argument", "quiesce: %s", body_err); free_strv(want); return; }
    if (nwant > 64) { send_error(sid, "invalid_argument", "quiesce: %zu devices, at most 64", nwant); free_strv(want); return; }
    for (size_t i = 0; i < nwant; i++) if (!dev_name_ok(want[i])) {
        send_error(sid, "invalid_argument", "quiesce: device %.40s is not a block device name ([a-z0-9], under 32 characters)", want[i]);
        free_strv(want); return;
    }
    if (!(secs >= 0)) secs = 0;     /* NaN too */
    if (secs > 120) secs = 120;
    int settled = settle(want, nwant, secs);
    free_strv(want);
    sync();
    if (!test_mode) {
        if (drop) write_file("/proc/sys/vm/drop_caches", "3");
        if (compact) write_file("/proc/sys/vm/compact_memory", "1");
    }
    buf_t b = {0};
    mp_map(&b, 6);
    mp_str(&b, "duration_s"); mp_float(&b, now_mono() - t0);
    mp_str(&b, "mem_available"); mp_int(&b, meminfo("MemAvailable"));
    mp_str(&b, "settled"); mp_bool(&b, settled);
    put_devices(&b);
    send_body(T_RESPONSE, sid, &b);
    buf_free(&b);
}

/* ---------------------------------------------------------------- clock
 * Under TCG the guest's clock runs on QEMU's virtual clock, which a memory file carries:
 * a resumed guest or a warm-pool clone is behind by the time it spent saved. The host
 * sends its own time after every restore. Bounded: a time outside 2024..2100 is refused
 * (a host clock that far off is a bug to report, not a time to copy). */
#define CLOCK_MIN_S 1704067200LL   /* 2024-01-01T00:00:00Z */
#define CLOCK_MAX_S 4102444800LL   /* 2100-01-01T00:00:00Z */
static void h_clock(uint64_t sid, mp_t body) {
    mp_t v; mphead_t h;
    if (mp_get(body, "unix_ns", &v) != 1 || mp_head(v.p, v.e, &h) != MP_INT) {
        send_error(sid, "invalid_argument", "clock: field unix_ns must be an integer (nanoseconds since 1970, UTC)");
        return;
    }
    int64_t ns = h.i;
    if (ns < CLOCK_MIN_S * 1000000000LL || ns > CLOCK_MAX_S * 1000000000LL) {
        send_error(sid, "invalid_argument", "clock: unix_ns %lld is outside 2024-01-01..2100-01-01; the guest clock was not changed", (long long)ns);
        return;
    }
    struct timespec before;
    clock_gettime(CLOCK_REALTIME, &before);
    int set = 0;
    if (!test_mode) {   /* a test agent runs on the host: never touch the host's clock */
        struct timespec ts = { .tv_sec = ns / 1000000000LL, .tv_nsec = ns % 1000000000LL };
        if (clock_settime(CLOCK_REALTIME, &ts) < 0) { send_errno(sid, errno, "clock_settime", ""); return; }
        set = 1;
    }
    buf_t b = {0};
    mp_map(&b, 2);
    mp_str(&b, "set"); mp_bool(&b, set);
    mp_str(&b, "step_s"); mp_float(&b, ns / 1e9 - (before.tv_sec + before.tv_nsec / 1e9));
    send_body(T_RESPONSE, sid, &b);
    buf_free(&b);
}

/* ---------------------------------------------------------------- dispatch */
static uint64_t last_sid = 0;
static void dispatch(uint64_t sid, const uint8_t *pl, size_t n, int flags) {
    body_err[0] = 0;
    if (n < 1 || pl[0] == 0 || n < 1u + pl[0]) { send_error(sid, "remote_protocol_error", "REQUEST payload too short for its method name"); return; }
    char m[256]; memcpy(m, pl + 1, pl[0]); m[pl[0]] = 0;
    mp_t body = { pl + 1 + pl[0], pl + n };
    if (body.p == body.e) { static const uint8_t nil = 0xc0; body.p = &nil; body.e = &nil + 1; }
    if (!mp_skip(body.p, body.e, 0)) { send_error(sid, "invalid_argument", "%s: the body is not valid msgpack", m); return; }
    int streaming = flags & F_STREAMING;
    cur_flags = flags;
    int wants_stream = !strcmp(m, "exec_stream") || !strcmp(m, "diff");
    if (wants_stream != !!streaming) {
        send_error(sid, "invalid_argument", "%s %s called with%s the STREAMING flag", m, wants_stream ? "is a streaming method but was" : "is a unary method but was", streaming ? "" : "out");
        return;
    }
    int needs_root = strcmp(m, "hello") && strcmp(m, "setup") && strcmp(m, "stats") && strcmp(m, "quiesce") && strcmp(m, "signal") && strcmp(m, "clock");
    if (needs_root && !setup_done && strcmp(m, "exec") && strcmp(m, "exec_stream") && strcmp(m, "diff")) {
        send_error(sid, "conflict", "%s before setup: call setup first", m); return;
    }
    if (!strcmp(m, "hello")) h_hello(sid);
    else if (!strcmp(m, "setup")) h_setup(sid, body);
    else if (!strcmp(m, "exec")) h_exec(sid, body, 0);
    else if (!strcmp(m, "exec_stream")) h_exec(sid, body, 1);
    else if (!strcmp(m, "signal")) h_signal(sid, body);
    else if (!strcmp(m, "read")) h_read(sid, body);
    else if (!strcmp(m, "write")) h_write(sid, body);
    else if (!strcmp(m, "list")) h_list(sid, body);
    else if (!strcmp(m, "stat")) h_stat(sid, body);
    else if (!strcmp(m, "mkdir")) h_mkdir(sid, body);
    else if (!strcmp(m, "remove")) h_remove(sid, body);
    else if (!strcmp(m, "rename")) h_rename(sid, body);
    else if (!strcmp(m, "quiesce")) h_quiesce(sid, body);
    else if (!strcmp(m, "diff")) h_diff(sid, streaming);
    else if (!strcmp(m, "stats")) h_stats(sid);
    else if (!strcmp(m, "clock")) h_clock(sid, body);
    else send_error(sid, "unknown_method", "the vm agent has no method %.200s", m);
}

static void on_frame(int type, uint64_t sid, const uint8_t *pl, size_t n, int flags) {
    switch (type) {
    case T_REQUEST:
        if (!(sid & 1)) { logf_("REQUEST on even stream %llu ignored", (unsigned long long)sid); return; }
        if (sid <= last_sid) {
            /* Aether stream ids only grow on one connection: this is a new host connection
             * whose close/open the agent did not see (both happened between two polls).
             * The old calls are abandoned so that no stale reply can answer a new call
             * that reuses their stream id. */
            for (int i = 0; i < MAX_EXECS; i++) job_abandon(&jobs[i]);
            connections++;
        }
        last_sid = sid;
        dispatch(sid, pl, n, flags);
        break;
    case T_PING: send_frame(T_PONG, sid, pl, n, 0); break;
    case T_CANCEL:
        for (int i = 0; i < MAX_EXECS; i++) if (jobs[i].used && jobs[i].sid == sid) job_abandon(&jobs[i]);
        break;
    case T_WINDOW:
        if (n == 4) {
            uint32_t inc = (uint32_t)rd_be(pl, 4);
            for (int i = 0; i < MAX_EXECS; i++) if (jobs[i].used && jobs[i].sid == sid && jobs[i].credit < INT64_MAX / 2) {
                jobs[i].credit += inc;
                if (jobs[i].credit > (1LL << 31)) jobs[i].credit = 1LL << 31;
            }
        }
        break;
    default: break;  /* GOAWAY, replies: nothing to do for an acceptor that makes no calls */
    }
}

/* parse whole frames out of inb; resynchronise on garbage */
static void parse_input(void) {
    size_t pos = 0;
    while (inb.len - pos >= HDR) {
        const uint8_t *h = inb.p + pos;
        uint32_t len = (uint32_t)rd_be(h + 15, 4);
        if (memcmp(h, "AETH", 4) || h[4] != 0 || h[5] != 1 || len > MAX_FRAME) {
            const uint8_t *nx = memmem(h + 1, inb.len - pos - 1, "AETH", 4);
            size_t skip = nx ? (size_t)(nx - h) : inb.len - pos - 3;
            logf_("skipping %zu bytes of garbage from the host", skip);
            pos += skip;
            continue;
        }
        if (inb.len - pos < HDR + (size_t)len) break;
        uint32_t crc = (uint32_t)rd_be(h + 21, 4);
        if (crc32_upd(crc32_upd(0, h, 21), h + HDR, len) != crc) {
            logf_("CRC mismatch: resynchronising");
            pos += 1;
            continue;
        }
        uint64_t sid = rd_be(h + 6, 8);
        int type = h[14], flags = (int)rd_be(h + 19, 2);
        on_frame(type, sid, h + HDR, len, flags);
        pos += HDR + len;
    }
    if (pos) buf_consume(&inb, pos);
}

static void on_disconnect(void) {
    if (!connected) return;
    connected = 0;
    buf_free(&inb); buf_free(&outb);
    last_sid = 0;
    for (int i = 0; i < MAX_EXECS; i++) job_abandon(&jobs[i]);
}

static void reap(void) {
    int st;
    pid_t p;
    while ((p = waitpid(-1, &st, WNOHANG)) > 0) {
        if (p == modules_pid) { modules_pid = 0; continue; }
        for (int i = 0; i < MAX_EXECS; i++) if (jobs[i].used && jobs[i].pid == p && !jobs[i].exited) {
            jobs[i].exited = 1; jobs[i].status = st; jobs[i].exit_at = now_mono();
            break;
        }
    }
}

/* ---------------------------------------------------------------- boot */
static int find_port(char *dev, size_t n) {
    DIR *d = opendir("/sys/class/virtio-ports");
    if (!d) return -1;
    struct dirent *de;
    int found = -1;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.') continue;
        char p[300], name[64] = "";
        snprintf(p, sizeof p, "/sys/class/virtio-ports/%s/name", de->d_name);
        FILE *f = fopen(p, "re");
        if (!f) continue;
        if (fgets(name, sizeof name, f)) name[strcspn(name, "\n")] = 0;
        fclose(f);
        if (!strcmp(name, "dsec.agent")) { snprintf(dev, n, "/dev/%s", de->d_name); found = 0; break; }
    }
    closedir(d);
    return found;
}

static void load_modules(void) {
    FILE *f = fopen("/lib/modules/load.order", "re");
    if (!f) return;
    char line[256];
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        if (!line[0]) continue;
        char p[320]; snprintf(p, sizeof p, "/lib/modules/%s", line);
        int fd = open(p, O_RDONLY | O_CLOEXEC);
        if (fd < 0) { logf_("module %s: %s", p, strerror(errno)); continue; }
        if (syscall(SYS_finit_module, fd, "", 0) < 0 && errno != EEXIST) logf_("loading %s: %s", line, strerror(errno));
        close(fd);
    }
    fclose(f);
}

static void boot(void) {
    mkdir("/proc", 0555); mkdir("/sys", 0555); mkdir("/dev", 0755); mkdir("/tmp", 01777);
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    mount("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    mount("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, NULL);
    /* fds 0-2 must be open before anything else is: without a console (no serial
     * device) the port could otherwise become fd 2 and the agent's log lines would be
     * written into the protocol stream */
    int c = open("/dev/console", O_RDWR | O_NOCTTY);
    if (c < 0) c = open("/dev/null", O_RDWR);
    if (c >= 0) { dup2(c, 0); dup2(c, 1); dup2(c, 2); if (c > 2) close(c); }
    /* modules load in a child while the agent looks for its port and answers hello
     * (~0.15 s under TCG); setup waits for it */
    modules_pid = fork();
    if (modules_pid == 0) { load_modules(); _exit(0); }
    if (modules_pid < 0) { modules_pid = 0; load_modules(); }
    write_file("/proc/sys/kernel/panic_on_oom", "0");
}

int main(int argc, char **argv) {
    crc_init();
    t_boot = now_mono();
    signal(SIGPIPE, SIG_IGN);
    for (int i = 1; i + 1 < argc; i++) {
        if (!strcmp(argv[i], "--fd")) { port_fd = atoi(argv[i + 1]); test_mode = 1; }
        if (!strcmp(argv[i], "--root")) snprintf(sb_path, sizeof sb_path, "%s", argv[i + 1]);
    }
    if (!test_mode) {
        if (getpid() != 1) { fprintf(stderr, "dsec-vm-agent runs as PID 1 of a guest, or with --fd N --root DIR for tests\n"); return 2; }
        boot();
    }
    FILE *bf = fopen("/proc/sys/kernel/random/boot_id", "re");
    if (bf) { if (fgets(boot_id, sizeof boot_id, bf)) boot_id[strcspn(boot_id, "\n")] = 0; fclose(bf); }
    sigset_t ss;
    sigemptyset(&ss); sigaddset(&ss, SIGCHLD); sigaddset(&ss, SIGIO);
    sigprocmask(SIG_BLOCK, &ss, NULL);
    int sfd = signalfd(-1, &ss, SFD_NONBLOCK | SFD_CLOEXEC);
    if (!test_mode) {
        char dev[300];
        double end = now_mono() + 30;
        while (find_port(dev, sizeof dev) < 0 || access(dev, F_OK) < 0) {
            if (now_mono() > end) { logf_("no virtio-serial port named dsec.agent after 30 s: powering off"); reboot(RB_POWER_OFF); }
            usleep(2000);
        }
        port_fd = open(dev, O_RDWR | O_NONBLOCK | O_CLOEXEC);
        if (port_fd < 0) { logf_("open %s: %s", dev, strerror(errno)); reboot(RB_POWER_OFF); }
        fcntl(port_fd, F_SETOWN, getpid());
        fcntl(port_fd, F_SETFL, fcntl(port_fd, F_GETFL) | O_ASYNC);
        logf_("serving on %s (%.3f s since start)", dev, now_mono() - t_boot);
    } else set_nb(port_fd);

    struct pollfd pf[2 + 3 * MAX_EXECS];
    job_t *pj[2 + 3 * MAX_EXECS];
    int pw[2 + 3 * MAX_EXECS];
    for (;;) {
        /* probe the port when not connected: POLLHUP means no host on the other side */
        if (!connected) {
            struct pollfd q = { port_fd, POLLIN, 0 };
            if (poll(&q, 1, 0) >= 0 && !(q.revents & POLLHUP) && !(test_mode && (q.revents & (POLLERR | POLLNVAL)))) {
                connected = 1; connections++;
            } else if (test_mode && (q.revents & POLLHUP)) {
                return 0;   /* test peer closed */
            }
        }
        int n = 0;
        pf[n] = (struct pollfd){ sfd, POLLIN, 0 }; pj[n] = NULL; n++;
        /* the host not reading its replies stops the agent reading its requests */
        if (connected) { pf[n] = (struct pollfd){ port_fd, (outb.len < 4 * OUT_HIGH ? POLLIN : 0) | (outb.len ? POLLOUT : 0), 0 }; pj[n] = NULL; n++; }
        /* disconnected: SIGIO (port open/close) wakes the loop; the 10 s probe is a fallback
         * that costs an idle guest one wakeup per 10 s, not per second */
        double now = now_mono(), wake = now + (connected ? 3600 : 10.0);
        for (int i = 0; i < MAX_EXECS; i++) {
            job_t *j = &jobs[i];
            if (!j->used) continue;
            if (outb.len <= OUT_HIGH && (j->credit > 0 || j->sid == 0 || j->kind == 0 || j->kind == 3)) {
                if (j->out_fd >= 0) { pf[n] = (struct pollfd){ j->out_fd, POLLIN, 0 }; pj[n] = j; pw[n] = 0; n++; }
                if (j->err_fd >= 0) { pf[n] = (struct pollfd){ j->err_fd, POLLIN, 0 }; pj[n] = j; pw[n] = 1; n++; }
            }
            if (j->in_fd >= 0) { pf[n] = (struct pollfd){ j->in_fd, POLLOUT, 0 }; pj[n] = j; pw[n] = 2; n++; }
            if (j->deadline && !j->timed_out && !j->exited && j->deadline < wake) wake = j->deadline;
            if (j->exited && (j->out_fd >= 0 || j->err_fd >= 0) && j->exit_at + 0.2 > now && j->exit_at + 0.2 < wake)
                wake = j->exit_at + 0.2;
        }
        int to = (int)((wake - now) * 1000) + 1;
        if (to < 0) to = 0;
        int r = poll(pf, n, to);
        if (r < 0 && errno != EINTR) { logf_("poll: %s", strerror(errno)); usleep(10000); }
        now = now_mono();
        for (int k = 0; r > 0 && k < n; k++) {
            if (!pf[k].revents) continue;
            if (pf[k].fd == sfd) {
                struct signalfd_siginfo si;
                while (read(sfd, &si, sizeof si) == sizeof si) {}
                reap();
            } else if (connected && pf[k].fd == port_fd) {
                if (pf[k].revents & POLLIN) {
                    for (;;) {
                        buf_reserve(&inb, 65536);
                        ssize_t rr = read(port_fd, inb.p + inb.len, 65536);
                        if (rr > 0) { inb.len += rr; if (inb.len > 2 * (MAX_FRAME + HDR)) break; continue; }
                        if (rr == 0) { on_disconnect(); break; }
                        if (errno == EINTR) continue;
                        if (errno != EAGAIN) on_disconnect();
                        break;
                    }
                    if (connected) parse_input();
                }
                if (connected && (pf[k].revents & (POLLHUP | POLLERR)) && !(pf[k].revents & POLLIN)) on_disconnect();
                if (connected && (pf[k].revents & POLLOUT)) flush_out();
            } else if (pj[k]) {
                job_t *j = pj[k];
                if (!j->used) continue;
                if (pw[k] == 2) {
                    ssize_t w = write(j->in_fd, j->in.p + j->in_off, j->in.len - j->in_off);
                    if (w > 0) j->in_off += w;
                    if ((w < 0 && errno != EAGAIN && errno != EINTR) || j->in_off >= j->in.len) { close(j->in_fd); j->in_fd = -1; buf_free(&j->in); }
                } else job_pump(j, pw[k]);
            }
        }
        /* deadlines and completion */
        for (int i = 0; i < MAX_EXECS; i++) {
            job_t *j = &jobs[i];
            if (!j->used) continue;
            if (j->deadline && !j->timed_out && !j->exited && now >= j->deadline) { j->timed_out = 1; kill(-j->pid, SIGKILL); }
            if (!j->exited) continue;
            if (j->kind == 3) { job_free(j); continue; }
            int open_ = (j->out_fd >= 0) + (j->err_fd >= 0);
            if (open_ && now < j->exit_at + 0.2) continue;   /* drain what the pipes still hold */
            if (open_ && j->kind == 1 && j->sid && j->credit <= 0) continue;  /* the reader first */
            if (open_ && j->kind != 2) { if (j->out_fd >= 0) job_pump(j, 0); if (j->err_fd >= 0) job_pump(j, 1); }
            if (j->kind == 2 && open_) continue;               /* diff: always read to EOF */
            if (outb.len > OUT_HIGH && j->kind == 1) continue;
            job_finish(j);
        }
        flush_out();
    }
}
