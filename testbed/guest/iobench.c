/*
 * iobench: the guest side of the emulated host's device benchmark (testbed/runner,
 * `virtio_vs_qemu`), built static by testbed/build-guest.sh and run inside vmhost's and QEMU's
 * guests alike. Every figure is timed by the guest's own CLOCK_MONOTONIC and printed as one
 * `IOBENCH <name> <value> <unit>` line on stdout (the serial console).
 *
 *   iobench seqwrite DEV MIB       MIB MiB of 1 MiB O_DIRECT writes from offset 0, then fdatasync
 *   iobench seqread  DEV MIB       MIB MiB of 1 MiB O_DIRECT reads from offset 0
 *   iobench randread DEV SECONDS   4 KiB O_DIRECT reads at random aligned offsets, queue depth 1
 *   iobench tcpsend  IP PORT MIB   connect, send MIB MiB, shutdown, wait for the peer's close
 *   iobench tcprecv  IP PORT MIB   connect, receive until MIB MiB arrived
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <linux/fs.h>

#define MIB (1024L * 1024L)

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void die(const char *what)
{
    fprintf(stdout, "IOBENCH-ERROR %s: %s\n", what, strerror(errno));
    fflush(stdout);
    exit(1);
}

static void *aligned(size_t len)
{
    void *p = NULL;
    if (posix_memalign(&p, 4096, len) != 0)
        die("posix_memalign");
    memset(p, 0x5a, len);
    return p;
}

static int seq(const char *dev, long mib, int write)
{
    int fd = open(dev, (write ? O_WRONLY : O_RDONLY) | O_DIRECT);
    if (fd < 0)
        die(dev);
    char *buf = aligned(MIB);
    double t0 = now();
    for (long i = 0; i < mib; i++) {
        ssize_t n = write ? pwrite(fd, buf, MIB, i * MIB) : pread(fd, buf, MIB, i * MIB);
        if (n != MIB)
            die(write ? "pwrite" : "pread");
    }
    if (write && fdatasync(fd) != 0)
        die("fdatasync");
    double secs = now() - t0;
    printf("IOBENCH %s %.1f MB/s\n", write ? "seqwrite" : "seqread",
           (double)(mib * MIB) / secs / 1e6);
    close(fd);
    return 0;
}

static int randread(const char *dev, double seconds)
{
    int fd = open(dev, O_RDONLY | O_DIRECT);
    if (fd < 0)
        die(dev);
    uint64_t size = 0;
    struct stat st;
    if (fstat(fd, &st) != 0)
        die("fstat");
    if (S_ISREG(st.st_mode))
        size = (uint64_t)st.st_size;
    else if (ioctl(fd, BLKGETSIZE64, &size) != 0)
        die("BLKGETSIZE64");
    uint64_t blocks = size / 4096;
    if (blocks == 0)
        die("empty device");
    char *buf = aligned(4096);
    uint64_t x = 0x9e3779b97f4a7c15ULL, ops = 0;
    double t0 = now(), t;
    do {
        for (int i = 0; i < 64; i++) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if (pread(fd, buf, 4096, (off_t)((x % blocks) * 4096)) != 4096)
                die("pread");
            ops++;
        }
        t = now() - t0;
    } while (t < seconds);
    printf("IOBENCH randread %.0f IOPS\n", (double)ops / t);
    close(fd);
    return 0;
}

static int tcp(const char *ip, int port, long mib, int send_side)
{
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0)
        die("socket");
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (inet_pton(AF_INET, ip, &a.sin_addr) != 1)
        die("address");
    double deadline = now() + 30;
    while (connect(s, (struct sockaddr *)&a, sizeof(a)) != 0) {
        if (now() > deadline)
            die("connect");
        usleep(100000);
    }
    char *buf = aligned(256 * 1024);
    long total = mib * MIB, done = 0;
    double t0 = now();
    while (done < total) {
        long want = total - done < 256 * 1024 ? total - done : 256 * 1024;
        ssize_t n = send_side ? send(s, buf, (size_t)want, 0) : recv(s, buf, (size_t)want, 0);
        if (n <= 0)
            die(send_side ? "send" : "recv");
        done += n;
    }
    if (send_side) {
        shutdown(s, SHUT_WR);
        while (recv(s, buf, 4096, 0) > 0) {
        }
    }
    double secs = now() - t0;
    printf("IOBENCH %s %.1f MB/s\n", send_side ? "tcpsend" : "tcprecv",
           (double)total / secs / 1e6);
    close(s);
    return 0;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc == 4 && strcmp(argv[1], "seqwrite") == 0)
        return seq(argv[2], atol(argv[3]), 1);
    if (argc == 4 && strcmp(argv[1], "seqread") == 0)
        return seq(argv[2], atol(argv[3]), 0);
    if (argc == 4 && strcmp(argv[1], "randread") == 0)
        return randread(argv[2], atof(argv[3]));
    if (argc == 5 && strcmp(argv[1], "tcpsend") == 0)
        return tcp(argv[2], atoi(argv[3]), atol(argv[4]), 1);
    if (argc == 5 && strcmp(argv[1], "tcprecv") == 0)
        return tcp(argv[2], atoi(argv[3]), atol(argv[4]), 0);
    fprintf(stderr, "usage: iobench seqwrite|seqread DEV MIB | randread DEV SECONDS | "
                    "tcpsend|tcprecv IP PORT MIB\n");
    return 2;
}
