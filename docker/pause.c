/*
 * The pod sandbox ("pause") process of the end-to-end node's static pause image
 * (docker/pause.Dockerfile; scripts/images.sh compiles it with `cc -static`).
 *
 * It holds the pod's namespaces open while the pod's containers come and go, and does
 * nothing else: as PID 1 of the sandbox it reaps any child it inherits, and it exits 0 on
 * SIGINT or SIGTERM (the runtime stops a sandbox with SIGTERM, then SIGKILL).
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int sig) {
    (void)sig;
    _exit(0);
}

static void on_child(int sig) {
    (void)sig;
    /* Reap every child that has exited; keep errno as it was for the interrupted code. */
    int saved = errno;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
    errno = saved;
}

int main(int argc, char **argv) {
    if (argc > 1 && (strcmp(argv[1], "--version") == 0 || strcmp(argv[1], "-v") == 0)) {
        puts("tandem-pause 1");
        return 0;
    }
    if (getpid() != 1) {
        fputs("tandem-pause: warning: not PID 1 of its namespace\n", stderr);
    }
    struct sigaction stop = {0}, child = {0};
    stop.sa_handler = on_stop;
    child.sa_handler = on_child;
    child.sa_flags = SA_NOCLDSTOP | SA_RESTART;
    if (sigaction(SIGINT, &stop, NULL) < 0 || sigaction(SIGTERM, &stop, NULL) < 0 ||
        sigaction(SIGCHLD, &child, NULL) < 0) {
        perror("tandem-pause: sigaction");
        return 1;
    }
    for (;;) {
        pause();
    }
}
