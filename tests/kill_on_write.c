/* kill_on_write.c - tests/kill.sh's helper: run a command and SIGKILL it as soon as the Nth file whose name ends in
   ".tmp" is created in DIR (dpar_ckpt_save writes each file to a temporary name first, then renames it: with one
   rank the 1st is the shard, the 2nd the manifest), so that the kill lands in the middle of a checkpoint write.
   Usage:   kill_on_write DIR N COMMAND [ARGS...]   (Linux: inotify)
   Exits:   137 after such a kill (and prints the file's name on stderr), else the command's own exit status;
            2 on a usage or system error. */
#define _GNU_SOURCE
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    char buf[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
    int fd, status, nth, seen = 0;
    pid_t pid;
    if (argc < 4 || (nth = atoi(argv[2])) < 1)
        return fprintf(stderr, "usage: kill_on_write DIR N COMMAND [ARGS...]\n"), 2;
    if ((fd = inotify_init1(IN_NONBLOCK)) < 0 || inotify_add_watch(fd, argv[1], IN_CREATE) < 0)
        return perror("kill_on_write: inotify"), 2;
    if ((pid = fork()) < 0) return perror("kill_on_write: fork"), 2;
    if (pid == 0) {
        close(fd);
        execvp(argv[3], argv + 3);
        perror("kill_on_write: exec");
        _exit(127);
    }
    for (;;) {
        struct pollfd p;
        ssize_t n, at;
        if (waitpid(pid, &status, WNOHANG) == pid)
            return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        p.fd = fd, p.events = POLLIN, p.revents = 0;
        if (poll(&p, 1, 5) <= 0) continue;
        n = read(fd, buf, sizeof buf);
        for (at = 0; n > 0 && at < n;) {
            struct inotify_event *e = (struct inotify_event *)(buf + at);
            size_t len = e->len ? strlen(e->name) : 0;
            if (len > 4 && !strcmp(e->name + len - 4, ".tmp") && ++seen == nth) {
                kill(pid, SIGKILL);
                waitpid(pid, &status, 0);
                fprintf(stderr, "kill_on_write: killed while '%s' was being written\n", e->name);
                return 137;
            }
            at += (ssize_t)sizeof *e + e->len;
        }
    }
}
