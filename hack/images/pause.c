/* Hermit's pod sandbox ("pause") process: holds the pod's namespaces, reaps
 * orphans and exits cleanly on SIGINT/SIGTERM. Built with gcc -static. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_term(int sig) { (void)sig; _exit(0); }

static void on_chld(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(int argc, char **argv) {
  if (argc > 1 && argv[1][0] == '-' && argv[1][1] == 'v') {
    puts("hermit-pause 1.0");
    return 0;
  }
  if (getpid() != 1) fputs("hermit-pause: warning: not running as pid 1\n", stderr);
  struct sigaction term = {.sa_handler = on_term};
  struct sigaction chld = {.sa_handler = on_chld, .sa_flags = SA_NOCLDSTOP};
  if (sigaction(SIGINT, &term, NULL) < 0 || sigaction(SIGTERM, &term, NULL) < 0 ||
      sigaction(SIGCHLD, &chld, NULL) < 0) {
    perror("hermit-pause: sigaction");
    return 1;
  }
  for (;;) pause();
}
