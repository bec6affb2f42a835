/*
 * forkrss.c - a program that never touches CUDA forks once: prints
 * "forkrss <parent's RssAnon kB> <the child's RssAnon kB, right after the fork>".
 * The library is preloaded into every process of a container: its fork handlers
 * must not fault in its tables in children of such programs (a child's anonymous
 * pages are the parent's, shared, plus what the handlers touched).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static long rss_anon_kb(void)
{
    static char buf[8192];
    int fd = open("/proc/self/status", O_RDONLY);
    ssize_t n = fd >= 0 ? read(fd, buf, sizeof(buf) - 1) : -1;
    if (fd >= 0) close(fd);
    if (n <= 0) return -1;
    buf[n] = '\0';
    const char *p = strstr(buf, "RssAnon:");
    return p ? strtol(p + 8, NULL, 10) : -1;
}

int main(void)
{
    int fd[2];
    if (pipe(fd) != 0) return 1;
    long parent = rss_anon_kb();
    pid_t pid = fork();
    if (pid < 0) return 1;
    if (pid == 0) {
        long child = rss_anon_kb();
        ssize_t w = write(fd[1], &child, sizeof(child));
        _exit(w == sizeof(child) ? 0 : 1);
    }
    long child = -1;
    ssize_t r = read(fd[0], &child, sizeof(child));
    int status = 0;
    waitpid(pid, &status, 0);
    if (r != sizeof(child) || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return 1;
    printf("forkrss %ld %ld\n", parent, child);
    return 0;
}
