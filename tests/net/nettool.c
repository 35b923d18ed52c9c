/* nettool: what a hostile agent inside a sandbox tries on the network, for the egress
 * tests (busybox has no raw-socket or spoofing tool). Built once per test session with
 * `gcc -static` and put into the test image at /bin/nettool.
 *
 *   nettool tcp HOST PORT DATA        connect (1.5 s), send DATA, print the reply
 *   nettool hold HOST PORT            connect, then echo lines stdin -> socket -> stdout
 *   nettool udp HOST PORT DATA        send one datagram
 *   nettool spoof SRC DST PORT DATA   raw IPv4/UDP packet with a forged source
 *   nettool icmp HOST                 ICMP echo over a raw socket, wait 1 s for a reply
 *   nettool tcp6 HOST PORT [DATA]     IPv6 connect (with DATA: send it, print the reply)
 *   nettool tls HOST PORT SNI         a TLS 1.2 ClientHello naming SNI, sent to HOST (IPv4
 *                                     or IPv6); prints "OK serverhello" when a TLS server
 *                                     answered it with a handshake record
 *   nettool setaddr IP                SIOCSIFADDR on eth0 (needs CAP_NET_ADMIN)
 *   nettool sysctl PATH VALUE         write /proc/sys/PATH
 * Prints "OK ..." or "ERR <errno name>: ..." and exits 0 / 1. */
#include <arpa/inet.h>
#include <errno.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/ip.h>
#include <netinet/udp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>
#include <fcntl.h>

static int fail(const char *what) {
    printf("ERR %s: %s\n", what, strerror(errno));
    return 1;
}

static void timeouts(int s, int ms) {
    struct timeval tv = {ms / 1000, (ms % 1000) * 1000};
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

static int v4(const char *host, int port, struct sockaddr_in *a) {
    memset(a, 0, sizeof *a);
    a->sin_family = AF_INET;
    a->sin_port = htons((unsigned short)port);
    return inet_pton(AF_INET, host, &a->sin_addr) == 1 ? 0 : -1;
}

static int tcp(const char *host, int port, const char *data) {
    struct sockaddr_in a;
    if (v4(host, port, &a) < 0) { errno = EINVAL; return fail("address"); }
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0) return fail("socket");
    timeouts(s, 1500);
    if (connect(s, (struct sockaddr *)&a, sizeof a) < 0) return fail("connect");
    if (send(s, data, strlen(data), MSG_NOSIGNAL) < 0) return fail("send");
    char buf[512];
    ssize_t n = recv(s, buf, sizeof buf - 1, 0);
    if (n < 0) return fail("recv");
    buf[n] = 0;
    printf("OK %s", buf);
    return 0;
}

static int hold(const char *host, int port) {
    struct sockaddr_in a;
    if (v4(host, port, &a) < 0) { errno = EINVAL; return fail("address"); }
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0) return fail("socket");
    timeouts(s, 1500);
    if (connect(s, (struct sockaddr *)&a, sizeof a) < 0) return fail("connect");
    printf("CONNECTED\n");
    fflush(stdout);
    char line[256];
    while (fgets(line, sizeof line, stdin)) {
        if (send(s, line, strlen(line), MSG_NOSIGNAL) < 0) { fail("send"); fflush(stdout); continue; }
        char buf[256];
        ssize_t n = recv(s, buf, sizeof buf - 1, 0);
        if (n <= 0) { if (n == 0) errno = ECONNRESET; fail("recv"); fflush(stdout); continue; }
        buf[n] = 0;
        printf("ECHO %s", buf);
        fflush(stdout);
    }
    return 0;
}

static int udp(const char *host, int port, const char *data) {
    struct sockaddr_in a;
    if (v4(host, port, &a) < 0) { errno = EINVAL; return fail("address"); }
    int s = socket(AF_INET, SOCK_DGRAM, 0);
    if (s < 0) return fail("socket");
    if (sendto(s, data, strlen(data), 0, (struct sockaddr *)&a, sizeof a) < 0) return fail("sendto");
    printf("OK sent\n");
    return 0;
}

static unsigned short csum(const void *p, size_t n) {
    const unsigned short *w = p;
    unsigned long sum = 0;
    for (; n > 1; n -= 2) sum += *w++;
    if (n) sum += *(const unsigned char *)w;
    while (sum >> 16) sum = (sum & 0xffff) + (sum >> 16);
    return (unsigned short)~sum;
}

static int spoof(const char *src, const char *dst, int port, const char *data) {
    unsigned char pkt[1500];
    size_t dl = strlen(data);
    if (dl > 1000) dl = 1000;
    struct iphdr *ip = (struct iphdr *)pkt;
    struct udphdr *u = (struct udphdr *)(pkt + sizeof *ip);
    memset(pkt, 0, sizeof pkt);
    ip->version = 4; ip->ihl = 5; ip->ttl = 64; ip->protocol = IPPROTO_UDP;
    ip->tot_len = htons((unsigned short)(sizeof *ip + sizeof *u + dl));
    if (inet_pton(AF_INET, src, &ip->saddr) != 1 || inet_pton(AF_INET, dst, &ip->daddr) != 1) {
        errno = EINVAL; return fail("address");
    }
    ip->check = csum(ip, sizeof *ip);
    u->source = htons(4444); u->dest = htons((unsigned short)port);
    u->len = htons((unsigned short)(sizeof *u + dl));
    memcpy(pkt + sizeof *ip + sizeof *u, data, dl);
    int s = socket(AF_INET, SOCK_RAW, IPPROTO_RAW);
    if (s < 0) return fail("socket(raw)");
    struct sockaddr_in a;
    v4(dst, 0, &a);
    if (sendto(s, pkt, sizeof *ip + sizeof *u + dl, 0, (struct sockaddr *)&a, sizeof a) < 0)
        return fail("sendto(raw)");
    printf("OK sent\n");
    return 0;
}

static int icmp(const char *host) {
    struct sockaddr_in a;
    if (v4(host, 0, &a) < 0) { errno = EINVAL; return fail("address"); }
    int s = socket(AF_INET, SOCK_RAW, IPPROTO_ICMP);
    if (s < 0) return fail("socket(icmp)");
    timeouts(s, 1000);
    unsigned char m[8] = {8, 0, 0, 0, 0x12, 0x34, 0, 1};
    unsigned short c = csum(m, sizeof m);
    memcpy(m + 2, &c, 2);
    if (sendto(s, m, sizeof m, 0, (struct sockaddr *)&a, sizeof a) < 0) return fail("sendto");
    unsigned char buf[256];
    ssize_t n = recv(s, buf, sizeof buf, 0);
    if (n < 0) return fail("recv");
    printf("OK reply\n");
    return 0;
}

static int tcp6(const char *host, int port, const char *data) {
    struct sockaddr_in6 a;
    memset(&a, 0, sizeof a);
    a.sin6_family = AF_INET6;
    a.sin6_port = htons((unsigned short)port);
    if (inet_pton(AF_INET6, host, &a.sin6_addr) != 1) { errno = EINVAL; return fail("address"); }
    int s = socket(AF_INET6, SOCK_STREAM, 0);
    if (s < 0) return fail("socket(inet6)");
    timeouts(s, 1500);
    if (connect(s, (struct sockaddr *)&a, sizeof a) < 0) return fail("connect");
    if (!data) { printf("OK connected\n"); return 0; }
    if (send(s, data, strlen(data), MSG_NOSIGNAL) < 0) return fail("send");
    char buf[512];
    ssize_t n = recv(s, buf, sizeof buf - 1, 0);
    if (n < 0) return fail("recv");
    buf[n] = 0;
    printf("OK %s", buf);
    return 0;
}

/* A ClientHello as a browser's would start: TLS 1.2, ECDHE suites, SNI, groups,
 * point formats, signature algorithms. Enough for an OpenSSL server to answer. */
static size_t client_hello(unsigned char *m, const char *sni) {
    size_t n = strlen(sni), o = 0, ext_len, hs_len;
    unsigned char ext[512];
    size_t e = 0;
    /* server_name */
    ext[e++] = 0; ext[e++] = 0;
    ext[e++] = (unsigned char)((n + 5) >> 8); ext[e++] = (unsigned char)(n + 5);
    ext[e++] = (unsigned char)((n + 3) >> 8); ext[e++] = (unsigned char)(n + 3);
    ext[e++] = 0;
    ext[e++] = (unsigned char)(n >> 8); ext[e++] = (unsigned char)n;
    memcpy(ext + e, sni, n); e += n;
    /* supported_groups: x25519, secp256r1 */
    static const unsigned char groups[] = {0, 10, 0, 6, 0, 4, 0, 29, 0, 23};
    memcpy(ext + e, groups, sizeof groups); e += sizeof groups;
    /* ec_point_formats: uncompressed */
    static const unsigned char points[] = {0, 11, 0, 2, 1, 0};
    memcpy(ext + e, points, sizeof points); e += sizeof points;
    /* signature_algorithms: rsa_pss_rsae_sha256, rsa_pkcs1_sha256, ecdsa_secp256r1_sha256 */
    static const unsigned char sigs[] = {0, 13, 0, 8, 0, 6, 8, 4, 4, 1, 4, 3};
    memcpy(ext + e, sigs, sizeof sigs); e += sizeof sigs;
    ext_len = e;
    static const unsigned char suites[] = {0xc0, 0x2f, 0xc0, 0x2b, 0xc0, 0x30, 0xc0, 0x2c};
    hs_len = 2 + 32 + 1 + 2 + sizeof suites + 2 + 2 + ext_len;
    m[o++] = 0x16; m[o++] = 3; m[o++] = 1;
    m[o++] = (unsigned char)((hs_len + 4) >> 8); m[o++] = (unsigned char)(hs_len + 4);
    m[o++] = 1; m[o++] = 0;
    m[o++] = (unsigned char)(hs_len >> 8); m[o++] = (unsigned char)hs_len;
    m[o++] = 3; m[o++] = 3;
    for (int i = 0; i < 32; i++) m[o++] = (unsigned char)(i * 7 + 1);
    m[o++] = 0;  /* no session id */
    m[o++] = 0; m[o++] = sizeof suites;
    memcpy(m + o, suites, sizeof suites); o += sizeof suites;
    m[o++] = 1; m[o++] = 0;  /* compression: null */
    m[o++] = (unsigned char)(ext_len >> 8); m[o++] = (unsigned char)ext_len;
    memcpy(m + o, ext, ext_len); o += ext_len;
    return o;
}

static int tls(const char *host, int port, const char *sni) {
    struct sockaddr_storage ss;
    socklen_t len;
    memset(&ss, 0, sizeof ss);
    struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)&ss;
    if (strchr(host, ':')) {
        a6->sin6_family = AF_INET6;
        a6->sin6_port = htons((unsigned short)port);
        if (inet_pton(AF_INET6, host, &a6->sin6_addr) != 1) { errno = EINVAL; return fail("address"); }
        len = sizeof *a6;
    } else {
        if (v4(host, port, (struct sockaddr_in *)&ss) < 0) { errno = EINVAL; return fail("address"); }
        len = sizeof(struct sockaddr_in);
    }
    if (strlen(sni) > 200) { errno = EINVAL; return fail("sni"); }
    int s = socket(ss.ss_family, SOCK_STREAM, 0);
    if (s < 0) return fail("socket");
    timeouts(s, 1500);
    if (connect(s, (struct sockaddr *)&ss, len) < 0) return fail("connect");
    unsigned char m[1024];
    size_t n = client_hello(m, sni);
    if (send(s, m, n, MSG_NOSIGNAL) < 0) return fail("send");
    unsigned char buf[16];
    ssize_t got = recv(s, buf, sizeof buf, 0);
    if (got < 0) return fail("recv");
    if (got == 0) { printf("OK closed\n"); return 0; }
    printf(buf[0] == 0x16 ? "OK serverhello\n" : "OK other %02x\n", buf[0]);
    return 0;
}

static int setaddr(const char *addr) {
    struct ifreq r;
    memset(&r, 0, sizeof r);
    strncpy(r.ifr_name, "eth0", IFNAMSIZ - 1);
    struct sockaddr_in *a = (struct sockaddr_in *)&r.ifr_addr;
    if (v4(addr, 0, a) < 0) { errno = EINVAL; return fail("address"); }
    int s = socket(AF_INET, SOCK_DGRAM, 0);
    if (s < 0) return fail("socket");
    if (ioctl(s, SIOCSIFADDR, &r) < 0) return fail("SIOCSIFADDR");
    printf("OK address set\n");
    return 0;
}

static int sysctl(const char *path, const char *value) {
    char p[256];
    snprintf(p, sizeof p, "/proc/sys/%s", path);
    int fd = open(p, O_WRONLY);
    if (fd < 0) return fail("open");
    if (write(fd, value, strlen(value)) < 0) return fail("write");
    printf("OK written\n");
    return 0;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc >= 5 && !strcmp(argv[1], "tcp")) return tcp(argv[2], atoi(argv[3]), argv[4]);
    if (argc >= 4 && !strcmp(argv[1], "hold")) return hold(argv[2], atoi(argv[3]));
    if (argc >= 5 && !strcmp(argv[1], "udp")) return udp(argv[2], atoi(argv[3]), argv[4]);
    if (argc >= 6 && !strcmp(argv[1], "spoof")) return spoof(argv[2], argv[3], atoi(argv[4]), argv[5]);
    if (argc >= 3 && !strcmp(argv[1], "icmp")) return icmp(argv[2]);
    if (argc >= 4 && !strcmp(argv[1], "tcp6"))
        return tcp6(argv[2], atoi(argv[3]), argc >= 5 ? argv[4] : NULL);
    if (argc >= 5 && !strcmp(argv[1], "tls")) return tls(argv[2], atoi(argv[3]), argv[4]);
    if (argc >= 3 && !strcmp(argv[1], "setaddr")) return setaddr(argv[2]);
    if (argc >= 4 && !strcmp(argv[1], "sysctl")) return sysctl(argv[2], argv[3]);
    fprintf(stderr, "usage: see nettool.c\n");
    return 2;
}
