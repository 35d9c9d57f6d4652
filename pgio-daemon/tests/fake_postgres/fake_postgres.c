/* A stand-in for a postgres binary in hostile tests: it exports `init_ps_display`, the
 * function pgio puts its title uretprobe on.
 *   <bin>                      waits until stdin closes (a postmaster that idles)
 *   <bin> flood SECS CHILDREN  once a byte arrives on stdin, forks CHILDREN children one
 *                              after another; each calls init_ps_display in a loop for
 *                              SECS seconds; prints the calls
 *   <bin> churn COUNT          forks COUNT children that exit at once, one after another
 *   <bin> forks COUNT [again]  the same, then prints COUNT and waits until stdin closes;
 *                              with `again`, execs itself to do it all once more first
 *   <bin> burst COUNT          once a byte arrives on stdin, forks COUNT children at once;
 *                              each calls init_ps_display, then execs this binary to idle;
 *                              prints COUNT, and ends them all when stdin closes */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

__attribute__((noinline, used)) void init_ps_display(const char *title) {
    __asm__ volatile("" : : "r"(title) : "memory");
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static long flood_child(double secs) {
    long calls = 0;
    double end = now() + secs;
    while (now() < end) {
        for (int i = 0; i < 1000; i++) {
            init_ps_display("flood");
            calls++;
        }
    }
    return calls;
}

int main(int argc, char **argv) {
    if (argc >= 4 && strcmp(argv[1], "flood") == 0) {
        double secs = atof(argv[2]);
        int children = atoi(argv[3]);
        long total = 0;
        char go;
        if (read(0, &go, 1) != 1) return 1;
        for (int c = 0; c < children; c++) {
            int fds[2];
            if (pipe(fds) != 0) return 1;
            pid_t pid = fork();
            if (pid < 0) return 1;
            if (pid == 0) {
                long calls = flood_child(secs);
                if (write(fds[1], &calls, sizeof calls) != sizeof calls) _exit(1);
                _exit(0);
            }
            close(fds[1]);
            long calls = 0;
            if (read(fds[0], &calls, sizeof calls) == sizeof calls) total += calls;
            close(fds[0]);
            waitpid(pid, NULL, 0);
        }
        printf("%ld\n", total);
        return 0;
    }
    if (argc >= 3 && (strcmp(argv[1], "churn") == 0 || strcmp(argv[1], "forks") == 0)) {
        int count = atoi(argv[2]);
        for (int c = 0; c < count; c++) {
            pid_t pid = fork();
            if (pid < 0) return 1;
            if (pid == 0) _exit(0);
            waitpid(pid, NULL, 0);
        }
        printf("%d\n", count);
        fflush(stdout);
        if (strcmp(argv[1], "forks") == 0 && argc >= 4 && strcmp(argv[3], "again") == 0) {
            /* By its path, not /proc/self/exe: the comm is the exec'd file's name. */
            execl(argv[0], argv[0], "forks", argv[2], (char *)NULL);
            return 1;
        }
        if (strcmp(argv[1], "forks") == 0) {
            char buf[64];
            while (read(0, buf, sizeof buf) > 0) {
            }
        }
        return 0;
    }
    if (argc >= 3 && strcmp(argv[1], "burst") == 0) {
        int count = atoi(argv[2]);
        char go;
        if (read(0, &go, 1) != 1) return 1;
        for (int c = 0; c < count; c++) {
            pid_t pid = fork();
            if (pid < 0) return 1;
            if (pid == 0) {
                init_ps_display("postgres: burst");
                execl("/proc/self/exe", argv[0], (char *)NULL);
                _exit(1);
            }
        }
        printf("%d\n", count);
        fflush(stdout);
        char buf[64];
        while (read(0, buf, sizeof buf) > 0) {
        }
        while (wait(NULL) > 0) {
        }
        return 0;
    }
    char buf[64];
    while (read(0, buf, sizeof buf) > 0) {
    }
    return 0;
}
