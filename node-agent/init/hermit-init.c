/*
 * hermit-init: the tiny PID 1 of Hermit sandbox containers (see README.md).
 *
 *   hermit-init [--grace SECONDS] [--] cmd args...      fresh start
 *   hermit-init --restore [--restore-timeout SECONDS] [--grace SECONDS] [-- cmd args...]
 *   hermit-init --install DEST                           copy itself to DEST (mode 0755)
 *
 * It forwards signals to its main child, reaps every zombie, and exits with the
 * main child's exit code (128+signal when it was killed). No malloc, no files
 * written, no fds held open between loop iterations, so CRIU dumps it cheaply.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef HERMIT_INIT_VERSION
#define HERMIT_INIT_VERSION "dev"
#endif

#define EXIT_USAGE 2
#define EXIT_FAILURE_INIT 1
#define EXIT_RESTORE_TIMEOUT 75 /* EX_TEMPFAIL: nothing was restored in time */
#define MAX_CHILDREN 1024

static const int forwarded[] = {SIGTERM, SIGINT,  SIGHUP,   SIGQUIT,
                                SIGUSR1, SIGUSR2, SIGWINCH, SIGCONT};

static pid_t main_pid;     /* 0: none yet; -1: adopted but unidentified */
static int main_done;      /* main child has exited */
static int main_status;    /* its wait status */
static int forward_group;  /* fresh start: signal the child's group if it made one */

static void msg(const char *fmt, ...) {
	char buf[512];
	int saved = errno;
	int n = snprintf(buf, sizeof(buf), "hermit-init: ");
	va_list ap;
	va_start(ap, fmt);
	n += vsnprintf(buf + n, sizeof(buf) - (size_t)n - 1, fmt, ap);
	va_end(ap);
	if (n > (int)sizeof(buf) - 2)
		n = (int)sizeof(buf) - 2;
	buf[n++] = '\n';
	if (write(STDERR_FILENO, buf, (size_t)n) < 0) { /* nothing better to do */ }
	errno = saved;
}

static void usage(FILE *out) {
	fprintf(out,
		"usage: hermit-init [--grace SECONDS] [--] CMD [ARGS...]\n"
		"       hermit-init --restore [--restore-timeout SECONDS] [--grace SECONDS] [-- CMD [ARGS...]]\n"
		"       hermit-init --install DEST\n"
		"       hermit-init --version | --help\n"
		"\n"
		"Runs CMD as its child (or, with --restore, adopts a process tree restored by CRIU),\n"
		"forwards TERM INT HUP QUIT USR1 USR2 WINCH CONT to it, reaps zombies and exits with\n"
		"its exit code (128+N if killed by signal N). Remaining processes get SIGTERM, then\n"
		"SIGKILL after --grace seconds (default 3).\n"
		"--restore waits up to --restore-timeout seconds (default 300, 0 = forever) for a\n"
		"child to appear; then exits 75, or starts CMD if HERMIT_RESTORE_FALLBACK=start.\n"
		"--install copies this binary to DEST (mode 0755): the init container of a sandbox\n"
		"pod runs it, so the init image needs nothing but hermit-init (no cp, no shell).\n");
}

/* Copies /proc/self/exe to dest. O_EXCL|O_NOFOLLOW: the target is a fresh emptyDir, so an
 * existing file or a symlink there is not ours to overwrite. */
static int install_self(const char *dest) {
	char buf[65536];
	int in = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
	if (in < 0) {
		msg("--install: open /proc/self/exe: %s", strerror(errno));
		return EXIT_FAILURE_INIT;
	}
	int out = open(dest, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0755);
	if (out < 0) {
		msg("--install: create %s: %s", dest, strerror(errno));
		close(in);
		return EXIT_FAILURE_INIT;
	}
	int rc = 0;
	for (;;) {
		ssize_t n = read(in, buf, sizeof(buf));
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0) {
			msg("--install: read /proc/self/exe: %s", strerror(errno));
			rc = EXIT_FAILURE_INIT;
			break;
		}
		if (n == 0)
			break;
		for (ssize_t off = 0; off < n;) {
			ssize_t w = write(out, buf + off, (size_t)(n - off));
			if (w < 0 && errno == EINTR)
				continue;
			if (w < 0) {
				msg("--install: write %s: %s", dest, strerror(errno));
				rc = EXIT_FAILURE_INIT;
				break;
			}
			off += w;
		}
		if (rc)
			break;
	}
	/* the umask may have cut the mode at open */
	if (!rc && fchmod(out, 0755) < 0) {
		msg("--install: chmod %s: %s", dest, strerror(errno));
		rc = EXIT_FAILURE_INIT;
	}
	if (close(out) < 0 && !rc) {
		msg("--install: close %s: %s", dest, strerror(errno));
		rc = EXIT_FAILURE_INIT;
	}
	close(in);
	if (rc)
		unlink(dest);
	return rc;
}

static long long now_ms(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int exit_code(int status) {
	if (WIFEXITED(status))
		return WEXITSTATUS(status);
	if (WIFSIGNALED(status))
		return 128 + WTERMSIG(status);
	return EXIT_FAILURE_INIT;
}

static int is_forwarded(int sig) {
	for (size_t i = 0; i < sizeof(forwarded) / sizeof(forwarded[0]); i++)
		if (forwarded[i] == sig)
			return 1;
	return 0;
}

/* Waits up to ms for one of the blocked signals; returns it, or 0 on timeout. */
static int wait_signal(const sigset_t *set, long ms) {
	struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
	siginfo_t si;
	int sig = sigtimedwait(set, &si, &ts);
	return sig < 0 ? 0 : sig; /* EAGAIN: timeout; EINTR: e.g. after a CRIU dump */
}

/* Reaps every exited child. Returns 1 while children remain, 0 when there are none. */
static int reap(void) {
	for (;;) {
		int st;
		pid_t r = waitpid(-1, &st, WNOHANG | __WALL);
		if (r > 0) {
			if (r == main_pid || main_pid < 0) {
				main_status = st;
				if (r == main_pid)
					main_done = 1;
			}
			continue;
		}
		if (r == 0)
			return 1;
		if (errno == EINTR)
			continue;
		if (errno != ECHILD)
			msg("waitpid: %s", strerror(errno));
		return 0;
	}
}

static int parse_pid(const char *s, pid_t *out) {
	char *end;
	errno = 0;
	long v = strtol(s, &end, 10);
	if (errno || end == s || v <= 0 || v > 0x3fffffff)
		return -1;
	*out = (pid_t)v;
	return 0;
}

/* ppid of pid from /proc/<pid>/stat ("pid (comm) S ppid ..."), or -1. */
static pid_t read_ppid(pid_t pid) {
	char path[64], buf[512];
	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	ssize_t n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return -1;
	buf[n] = '\0';
	char *p = strrchr(buf, ')');
	pid_t ppid;
	if (!p || strlen(p) < 5 || parse_pid(p + 4, &ppid) < 0)
		return -1;
	return ppid;
}

/* Lists our children (pids as seen in our /proc). Returns the count, or -1 if /proc is unusable. */
static int list_children(pid_t *out, int max) {
	char path[64], buf[4096];
	int count = 0;
	snprintf(path, sizeof(path), "/proc/self/task/%d/children", (int)getpid());
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd >= 0) {
		long cur = -1;
		ssize_t n;
		while ((n = read(fd, buf, sizeof(buf))) > 0) {
			for (ssize_t i = 0; i < n; i++) {
				if (buf[i] >= '0' && buf[i] <= '9') {
					cur = (cur < 0 ? 0 : cur * 10) + (buf[i] - '0');
				} else if (cur >= 0) {
					if (count < max)
						out[count++] = (pid_t)cur;
					cur = -1;
				}
			}
		}
		if (cur >= 0 && count < max)
			out[count++] = (pid_t)cur;
		close(fd);
		if (n == 0)
			return count;
		count = 0;
	}
	/* Kernel without CONFIG_PROC_CHILDREN: scan /proc for ppid == us. */
	DIR *d = opendir("/proc");
	if (!d)
		return -1;
	pid_t self = getpid();
	struct dirent *e;
	while ((e = readdir(d)) != NULL && count < max) {
		pid_t pid;
		if (parse_pid(e->d_name, &pid) == 0 && read_ppid(pid) == self)
			out[count++] = pid;
	}
	closedir(d);
	return count;
}

/* Sends sig to every other process we are responsible for. */
static void signal_others(int sig) {
	if (getpid() == 1) { /* the whole pid namespace, except us */
		if (kill(-1, sig) < 0 && errno != ESRCH)
			msg("kill(-1, %d): %s", sig, strerror(errno));
		return;
	}
	pid_t kids[MAX_CHILDREN];
	int n = list_children(kids, MAX_CHILDREN);
	for (int i = 0; i < n; i++)
		kill(kids[i], sig);
}

static void forward(int sig) {
	if (main_pid < 0) { /* adopted, but /proc could not say which: everyone */
		signal_others(sig);
		return;
	}
	if (main_pid == 0 || main_done)
		return;
	if (forward_group && getpgid(main_pid) == main_pid && kill(-main_pid, sig) == 0)
		return;
	if (kill(main_pid, sig) < 0 && errno != ESRCH)
		msg("forwarding signal %d to %d: %s", sig, (int)main_pid, strerror(errno));
}

/* After the main child exited: SIGTERM the rest, wait grace_ms, then SIGKILL. */
static void shutdown_others(const sigset_t *set, long grace_ms) {
	if (!reap())
		return;
	signal_others(SIGTERM);
	signal_others(SIGCONT);
	long long deadline = now_ms() + grace_ms;
	while (now_ms() < deadline) {
		if (!reap())
			return;
		wait_signal(set, 50);
	}
	msg("processes left after %ld ms grace; sending SIGKILL", grace_ms);
	deadline = now_ms() + 5000;
	while (reap() && now_ms() < deadline) {
		signal_others(SIGKILL); /* again each round: orphans reparent to us */
		wait_signal(set, 20);
	}
}

static void spawn(char **cmd, const sigset_t *orig) {
	pid_t pid = fork();
	if (pid < 0) {
		msg("fork: %s", strerror(errno));
		exit(EXIT_FAILURE_INIT);
	}
	if (pid == 0) {
		sigprocmask(SIG_SETMASK, orig, NULL);
		execvp(cmd[0], cmd);
		int code = (errno == ENOENT) ? 127 : 126;
		msg("exec %s: %s", cmd[0], strerror(errno));
		_exit(code);
	}
	main_pid = pid;
	forward_group = 1;
}

/* Waits for a restored tree to be reparented to us. Returns 1 when adopted, 0 on timeout. */
static int await_restore(const sigset_t *set, long timeout_s) {
	long long deadline = timeout_s > 0 ? now_ms() + timeout_s * 1000LL : 0;
	int pending = 0; /* a stop signal: adopt what is there and forward it, or exit */
	for (;;) {
		int st;
		pid_t r = waitpid(-1, &st, WNOHANG | __WALL);
		if (r > 0) { /* adopted and already gone */
			main_pid = r;
			main_status = st;
			main_done = 1;
			return 1;
		}
		if (r == 0) {
			pid_t kids[MAX_CHILDREN];
			int n = list_children(kids, MAX_CHILDREN);
			main_pid = n > 0 ? kids[0] : -1;
			if (main_pid > 0)
				msg("adopted restored process %d", (int)main_pid);
			else
				msg("adopted a restored process, but /proc cannot tell which; waiting for all");
			if (pending)
				forward(pending);
			return 1;
		}
		if (errno != ECHILD && errno != EINTR)
			msg("waitpid: %s", strerror(errno));
		if (pending) {
			msg("received signal %d while waiting for a restore; exiting", pending);
			exit(128 + pending);
		}
		if (deadline && now_ms() >= deadline)
			return 0;
		int sig = wait_signal(set, 50);
		if (sig == SIGTERM || sig == SIGINT || sig == SIGHUP || sig == SIGQUIT)
			pending = sig;
	}
}

static int parse_seconds(const char *opt, const char *val, long *out) {
	char *end;
	errno = 0;
	long v = val ? strtol(val, &end, 10) : -1;
	if (!val || errno || end == val || *end || v < 0 || v > 100000000L) {
		msg("%s needs a number of seconds, got '%s'", opt, val ? val : "");
		return -1;
	}
	*out = v;
	return 0;
}

int main(int argc, char **argv) {
	int restore = 0;
	long restore_timeout = 300, grace = 3;
	int i = 1;
	for (; i < argc; i++) {
		const char *a = argv[i];
		if (strcmp(a, "--") == 0) {
			i++;
			break;
		} else if (strcmp(a, "--restore") == 0) {
			restore = 1;
		} else if (strcmp(a, "--restore-timeout") == 0 || strcmp(a, "--grace") == 0) {
			long *dst = a[2] == 'g' ? &grace : &restore_timeout;
			if (parse_seconds(a, i + 1 < argc ? argv[i + 1] : NULL, dst) < 0)
				return EXIT_USAGE;
			i++;
		} else if (strcmp(a, "--install") == 0) {
			if (i + 1 >= argc || i + 2 != argc) {
				msg("--install needs exactly one argument, the destination path");
				return EXIT_USAGE;
			}
			return install_self(argv[i + 1]);
		} else if (strcmp(a, "--version") == 0) {
			printf("hermit-init %s\n", HERMIT_INIT_VERSION);
			return 0;
		} else if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
			usage(stdout);
			return 0;
		} else if (a[0] == '-') {
			msg("unknown option '%s' (try --help)", a);
			return EXIT_USAGE;
		} else {
			break;
		}
	}
	char **cmd = i < argc ? argv + i : NULL;
	if (!restore && !cmd) {
		msg("no command given (usage: hermit-init [--] CMD [ARGS...])");
		return EXIT_USAGE;
	}

	sigset_t set, orig;
	sigemptyset(&set);
	for (size_t k = 0; k < sizeof(forwarded) / sizeof(forwarded[0]); k++)
		sigaddset(&set, forwarded[k]);
	sigaddset(&set, SIGCHLD);
	if (sigprocmask(SIG_BLOCK, &set, &orig) < 0) {
		msg("sigprocmask: %s", strerror(errno));
		return EXIT_FAILURE_INIT;
	}
	/* CRIU can only dump a pid namespace whose init leads its own session. */
	if (getpid() == 1 && getsid(0) != 1 && setsid() < 0)
		msg("setsid: %s", strerror(errno));
	if (getpid() != 1 && prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) < 0)
		msg("PR_SET_CHILD_SUBREAPER: %s (orphans will not be reaped)", strerror(errno));

	if (!restore) {
		spawn(cmd, &orig);
	} else if (!await_restore(&set, restore_timeout)) {
		const char *fb = getenv("HERMIT_RESTORE_FALLBACK");
		if (!cmd || !fb || strcmp(fb, "start") != 0) {
			msg("no restored process appeared within %ld s; giving up", restore_timeout);
			return EXIT_RESTORE_TIMEOUT;
		}
		msg("no restored process appeared within %ld s; HERMIT_RESTORE_FALLBACK=start: "
		    "starting %s", restore_timeout, cmd[0]);
		spawn(cmd, &orig);
	}

	while (!main_done) {
		int sig = wait_signal(&set, 1000);
		if (is_forwarded(sig)) {
			forward(sig);
			continue;
		}
		if (!reap() && main_pid < 0)
			main_done = 1; /* unidentified main: done when nothing is left */
	}
	shutdown_others(&set, grace * 1000);
	return exit_code(main_status);
}
