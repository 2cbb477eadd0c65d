/* The workload of the process-mode compatibility fixtures (tests/fixtures/compat/): counts to
 * N, 50 ms a step, appending "<n>\n" to a file and rewriting one 4 KiB page of a 256 KiB
 * table from n (page n*7 mod 64), so that a later snapshot's image differs from an earlier one
 * in scattered pages: the page deltas of the store's format.
 *
 *     counter FILE N
 *
 * No C library (raw x86_64 system calls, no build id, no compiler note), so the same source
 * builds to the same bytes with any gcc that makes the same code: a CRIU image maps its
 * executable by path and size, and the fixture's images must restore onto a binary built
 * here years later. Exits 0 after step N-1, 3 on bad arguments, 4 if the file cannot be
 * opened, 5 if the page the last step wrote does not hold what it wrote (memory came back
 * wrong).
 */

#define SYS_WRITE 1
#define SYS_OPEN 2
#define SYS_NANOSLEEP 35
#define SYS_EXIT 60
#define O_WRONLY 01
#define O_CREAT 0100
#define O_APPEND 02000
#define PAGE_WORDS 1024
#define PAGES 64

static unsigned int table[PAGES][PAGE_WORDS];

static long syscall3(long n, long a, long b, long c) {
    long ret;
    __asm__ volatile("syscall" : "=a"(ret) : "a"(n), "D"(a), "S"(b), "d"(c)
                     : "rcx", "r11", "memory");
    return ret;
}

static __attribute__((noreturn)) void leave(int code) {
    for (;;) syscall3(SYS_EXIT, code, 0, 0);
}

static long parse(const char *s) {
    long v = 0;
    if (!*s) return -1;
    for (; *s; s++) {
        if (*s < '0' || *s > '9' || v > 100000000) return -1;
        v = v * 10 + (*s - '0');
    }
    return v;
}

static unsigned int mix(unsigned int n, unsigned int i) {
    unsigned int x = n * 2654435761u ^ i * 40503u;
    return x ^ (x >> 15);
}

void counter_main(long *stack) {
    long argc = stack[0];
    char **argv = (char **)(stack + 1);
    if (argc != 3) leave(3);
    long total = parse(argv[2]);
    if (total < 0) leave(3);
    long fd = syscall3(SYS_OPEN, (long)argv[1], O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd < 0) leave(4);
    struct { long sec, nsec; } pause = {0, 50000000};
    for (unsigned int p = 0; p < PAGES; p++)  /* every page in the image from the first dump */
        for (unsigned int i = 0; i < PAGE_WORDS; i++) table[p][i] = mix(~p, i);
    for (long n = 0; n < total; n++) {
        if (n > 0) {
            unsigned int *last = table[(n - 1) * 7 % PAGES];
            for (unsigned int i = 0; i < PAGE_WORDS; i++)
                if (last[i] != mix((unsigned int)(n - 1), i)) leave(5);
        }
        unsigned int *page = table[n * 7 % PAGES];
        for (unsigned int i = 0; i < PAGE_WORDS; i++) page[i] = mix((unsigned int)n, i);
        char line[24];
        int len = 0;
        char digits[20];
        long v = n;
        do { digits[len++] = (char)('0' + v % 10); v /= 10; } while (v);
        for (int i = 0; i < len; i++) line[i] = digits[len - 1 - i];
        line[len] = '\n';
        syscall3(SYS_WRITE, fd, (long)line, len + 1);
        syscall3(SYS_NANOSLEEP, (long)&pause, 0, 0);
    }
    leave(0);
}

__asm__(".globl _start\n"
        "_start:\n"
        "    mov %rsp, %rdi\n"
        "    and $-16, %rsp\n"
        "    call counter_main\n"
        "    hlt\n");
