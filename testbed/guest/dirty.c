/*
 * dirty: the guest side of the live-migration benchmark (testbed/runner/src/migration_bench.rs),
 * a static helper.
 *
 *   dirty BUF_MIB RATE_MIB_S
 *
 * Touches a buffer of BUF_MIB MiB once (so all of it is resident), prints
 * "GUEST-DIRTY buf_mib=B rate_mib_s=R period_ms=10", then every 10 ms (CLOCK_MONOTONIC,
 * absolute deadlines) writes RATE_MIB_S / 100 MiB of it (whole 4 KiB pages, going round the
 * buffer; fractions carried over) and prints a beat line "B <n>" on stdout (the serial
 * console). The host timestamps every beat as it arrives: the longest gap between two beats
 * across a migration is the downtime seen from outside. A deadline already past (the VM was
 * paused) is not caught up with a burst of beats: the next one is 10 ms after now.
 * RATE_MIB_S 0 (and BUF_MIB 0) is the idle guest: beats only.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define PERIOD_NS 10000000L
#define PAGE 4096UL

static void add_ns(struct timespec *t, long ns) {
    t->tv_nsec += ns;
    while (t->tv_nsec >= 1000000000L) {
        t->tv_nsec -= 1000000000L;
        t->tv_sec++;
    }
}

static int before(const struct timespec *a, const struct timespec *b) {
    return a->tv_sec < b->tv_sec || (a->tv_sec == b->tv_sec && a->tv_nsec < b->tv_nsec);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: dirty BUF_MIB RATE_MIB_S\n");
        return 2;
    }
    unsigned long buf_mib = strtoul(argv[1], NULL, 10), rate = strtoul(argv[2], NULL, 10);
    unsigned long pages = (buf_mib << 20) / PAGE;
    unsigned char *buf = NULL;
    if (pages > 0) {
        buf = mmap(NULL, pages * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (buf == MAP_FAILED) {
            perror("dirty: mmap");
            return 1;
        }
        memset(buf, 1, pages * PAGE);
    }
    printf("GUEST-DIRTY buf_mib=%lu rate_mib_s=%lu period_ms=10\n", buf_mib, rate);
    fflush(stdout);
    /* Pages per period in 1/100 units: rate MiB/s = rate * 256 pages/s = rate * 256 / 100
     * pages per 10 ms. */
    unsigned long owed = 0, pos = 0, n = 0;
    struct timespec next, now;
    clock_gettime(CLOCK_MONOTONIC, &next);
    for (;;) {
        if (pages > 0) {
            owed += rate * 256;
            for (; owed >= 100; owed -= 100) {
                memset(buf + pos * PAGE, (int)(n & 0xff), PAGE);
                pos = (pos + 1) % pages;
            }
        }
        char line[32];
        int len = snprintf(line, sizeof line, "B %lu\n", n++);
        if (write(1, line, (size_t)len) < 0) return 1;
        add_ns(&next, PERIOD_NS);
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (before(&next, &now)) {
            next = now;
            add_ns(&next, PERIOD_NS);
        }
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &next, NULL);
    }
}
