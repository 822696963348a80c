/*
 * vsock-test: the guest side of the emulated-host vsock test (testbed/runner/src/vsock_tests.rs),
 * a static helper because busybox has no AF_VSOCK.
 *
 *   vsock-test serve PORT          listen on PORT, print "GUEST-VSOCK-LISTENING port=PORT",
 *                                  echo one connection until EOF, print "GUEST vsock_served=N"
 *   vsock-test connect PORT BYTES  connect to the host (CID 2) port PORT, send BYTES of the test
 *                                  pattern while reading the echo back, print
 *                                  "GUEST vsock_g2h=ok bytes=N" or "GUEST vsock_g2h=fail ..."
 *
 * The pattern (byte i = (i * 131 + (i >> 8)) & 0xff) is the one the host side checks.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#include <linux/vm_sockets.h>

static unsigned char pattern(unsigned long i) { return (unsigned char)(i * 131 + (i >> 8)); }

static int serve(unsigned port) {
    struct sockaddr_vm addr = {.svm_family = AF_VSOCK, .svm_cid = VMADDR_CID_ANY, .svm_port = port};
    int l = socket(AF_VSOCK, SOCK_STREAM, 0);
    if (l < 0 || bind(l, (struct sockaddr *)&addr, sizeof addr) < 0 || listen(l, 1) < 0) {
        printf("GUEST vsock_served=error listen:%s\n", strerror(errno));
        return 1;
    }
    printf("GUEST-VSOCK-LISTENING port=%u\n", port);
    fflush(stdout);
    int c = accept(l, NULL, NULL);
    if (c < 0) {
        printf("GUEST vsock_served=error accept:%s\n", strerror(errno));
        return 1;
    }
    static char buf[65536];
    unsigned long total = 0;
    for (;;) {
        ssize_t n = read(c, buf, sizeof buf);
        if (n == 0) break;
        if (n < 0) {
            if (errno == EINTR) continue;
            printf("GUEST vsock_served=error read:%s\n", strerror(errno));
            return 1;
        }
        for (ssize_t off = 0; off < n;) {
            ssize_t w = write(c, buf + off, n - off);
            if (w < 0) {
                if (errno == EINTR) continue;
                printf("GUEST vsock_served=error write:%s\n", strerror(errno));
                return 1;
            }
            off += w;
        }
        total += n;
    }
    close(c);
    close(l);
    printf("GUEST vsock_served=%lu\n", total);
    return 0;
}

static int connect_host(unsigned port, unsigned long bytes) {
    struct sockaddr_vm addr = {.svm_family = AF_VSOCK, .svm_cid = VMADDR_CID_HOST, .svm_port = port};
    int s = socket(AF_VSOCK, SOCK_STREAM, 0);
    if (s < 0 || connect(s, (struct sockaddr *)&addr, sizeof addr) < 0) {
        printf("GUEST vsock_g2h=fail connect:%s\n", strerror(errno));
        return 1;
    }
    pid_t writer = fork();
    if (writer == 0) {
        static unsigned char out[65536];
        unsigned long sent = 0;
        while (sent < bytes) {
            size_t n = bytes - sent < sizeof out ? bytes - sent : sizeof out;
            for (size_t i = 0; i < n; i++) out[i] = pattern(sent + i);
            for (size_t off = 0; off < n;) {
                ssize_t w = write(s, out + off, n - off);
                if (w < 0) {
                    if (errno == EINTR) continue;
                    _exit(1);
                }
                off += w;
            }
            sent += n;
        }
        shutdown(s, SHUT_WR);
        _exit(0);
    }
    static unsigned char in[65536];
    unsigned long got = 0;
    while (got < bytes) {
        ssize_t n = read(s, in, sizeof in);
        if (n <= 0) {
            if (n < 0 && errno == EINTR) continue;
            printf("GUEST vsock_g2h=fail short:%lu\n", got);
            return 1;
        }
        for (ssize_t i = 0; i < n; i++) {
            if (in[i] != pattern(got + i)) {
                printf("GUEST vsock_g2h=fail mismatch_at:%lu\n", got + i);
                return 1;
            }
        }
        got += n;
    }
    int status = 0;
    waitpid(writer, &status, 0);
    close(s);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        printf("GUEST vsock_g2h=fail writer\n");
        return 1;
    }
    printf("GUEST vsock_g2h=ok bytes=%lu\n", got);
    return 0;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc == 3 && strcmp(argv[1], "serve") == 0) return serve((unsigned)strtoul(argv[2], NULL, 10));
    if (argc == 4 && strcmp(argv[1], "connect") == 0)
        return connect_host((unsigned)strtoul(argv[2], NULL, 10), strtoul(argv[3], NULL, 10));
    fprintf(stderr, "usage: vsock-test serve PORT | connect PORT BYTES\n");
    return 2;
}
