/*
 * hermit-stateful: the stateful workload of Hermit's migration tests and benchmarks.
 *
 * Its state lives in memory and in kernel objects that CRIU must carry over:
 * an in-memory counter (never re-read from disk), a log fd opened once in append
 * mode, a listening TCP socket, a child process connected over a pipe, and an
 * optional block of patterned memory that is verified continuously.
 * Configuration is by environment only (see --help and README in node-agent/init).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef HERMIT_WORKLOAD_VERSION
#define HERMIT_WORKLOAD_VERSION "dev"
#endif

#define EXIT_SETUP 1
#define EXIT_MEMORY_CORRUPT 3
#define EXIT_CHILD_LOST 4

static volatile sig_atomic_t stop_signal;
static char state_dir[1024];

static void on_stop(int sig) { stop_signal = sig; }

static void out(int fd, const char *fmt, ...) {
	char buf[512];
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(buf, sizeof(buf), fmt, ap);
	va_end(ap);
	if (n > (int)sizeof(buf) - 1)
		n = (int)sizeof(buf) - 1;
	if (n > 0 && write(fd, buf, (size_t)n) < 0) { /* stdout may be gone; keep going */ }
}

static void die(const char *what) {
	out(2, "hermit-stateful: %s: %s\n", what, strerror(errno));
	exit(EXIT_SETUP);
}

static const char *env_str(const char *name, const char *dflt) {
	const char *v = getenv(name);
	return v ? v : dflt;
}

static long env_long(const char *name, long dflt, long min, long max) {
	const char *v = getenv(name);
	if (!v || !*v)
		return dflt;
	char *end;
	errno = 0;
	long n = strtol(v, &end, 10);
	if (errno || *end || n < min || n > max) {
		out(2, "hermit-stateful: %s must be an integer in [%ld, %ld], got '%s'\n", name, min,
		    max, v);
		exit(EXIT_SETUP);
	}
	return n;
}

static long long now_ms(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void mkdir_p(const char *dir) {
	char p[1024];
	snprintf(p, sizeof(p), "%s", dir);
	for (char *s = p + 1; *s; s++) {
		if (*s == '/') {
			*s = '\0';
			mkdir(p, 0755);
			*s = '/';
		}
	}
	if (mkdir(p, 0755) < 0 && errno != EEXIST)
		die(dir);
}

/* Rewrites <state_dir>/<name> with text. */
static int write_state(const char *name, const char *fmt, ...) {
	char path[1200], buf[256];
	snprintf(path, sizeof(path), "%s/%s", state_dir, name);
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(buf, sizeof(buf), fmt, ap);
	va_end(ap);
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd < 0)
		return -1;
	ssize_t w = write(fd, buf, (size_t)n);
	close(fd);
	return w == n ? 0 : -1;
}

static uint64_t pattern(size_t i) { return (uint64_t)i * 0x9E3779B97F4A7C15ULL ^ 0x4845524D4954ULL; }

/* The background child: heartbeats into a file and over the pipe until the parent goes. */
static void child_main(int wfd, pid_t parent, long beat_ms) {
	signal(SIGTERM, SIG_DFL);
	signal(SIGINT, SIG_DFL);
	write_state("child.pid", "%d\n", (int)getpid());
	for (long beats = 1;; beats++) {
		struct timespec ts = {beat_ms / 1000, (beat_ms % 1000) * 1000000L};
		nanosleep(&ts, NULL);
		if (getppid() != parent)
			_exit(0);
		write_state("child.txt", "pid=%d beats=%ld\n", (int)getpid(), beats);
		if (write(wfd, "b", 1) < 0 && errno != EINTR && errno != EAGAIN)
			_exit(0);
	}
}

static int listen_tcp(const char *addr, long port) {
	int s = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (s < 0)
		die("socket");
	int one = 1;
	setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	struct sockaddr_in a;
	memset(&a, 0, sizeof(a));
	a.sin_family = AF_INET;
	a.sin_port = htons((uint16_t)port);
	if (inet_pton(AF_INET, addr, &a.sin_addr) != 1) {
		out(2, "hermit-stateful: HERMIT_LISTEN_ADDR '%s' is not an IPv4 address\n", addr);
		exit(EXIT_SETUP);
	}
	if (bind(s, (struct sockaddr *)&a, sizeof(a)) < 0)
		die("bind");
	if (listen(s, 64) < 0)
		die("listen");
	return s;
}

static void usage(void) {
	fputs("usage: hermit-stateful [--help|--version]   (configured by environment)\n"
	       "  HERMIT_TICK_MS=100          tick period\n"
	       "  PORT=7000                   TCP port; answers 'counter=<n> child=<pid>\\n'\n"
	       "  HERMIT_LISTEN_ADDR=0.0.0.0  IPv4 address to listen on\n"
	       "  HERMIT_STATE_DIR=/state     counter.txt, created.txt, child.pid, child.txt\n"
	       "  HERMIT_TICK_LOG=/workspace/ticks.log   'tick <n>' appended per tick\n"
	       "  HERMIT_DELETE_PATH=/etc/hermit-delete-me   deleted at start ('' = none)\n"
	       "  HERMIT_WORKLOAD_MEM_MB=0    patterned memory, verified each tick (exit 3 if bad)\n"
	       "  HERMIT_WORKLOAD_VERIFY_MB=64  memory verified per tick (rolling)\n"
	       "  HERMIT_CHILD_MS=500         child heartbeat period\n"
	       "  HERMIT_MAX_TICKS=0          exit 0 after this many ticks (0 = never)\n"
	       "Exit: 0 on SIGTERM/SIGINT or max ticks, 1 setup error, 3 memory corrupted,\n"
	       "4 background child lost.\n", stdout);
}

int main(int argc, char **argv) {
	if (argc > 1 && strcmp(argv[1], "--version") == 0) {
		out(1, "hermit-stateful %s\n", HERMIT_WORKLOAD_VERSION);
		return 0;
	}
	if (argc > 1) {
		usage();
		return strcmp(argv[1], "--help") == 0 ? 0 : 2;
	}
	long tick_ms = env_long("HERMIT_TICK_MS", 100, 1, 3600000);
	long port = env_long("PORT", 7000, 0, 65535);
	long mem_mb = env_long("HERMIT_WORKLOAD_MEM_MB", 0, 0, 1 << 20);
	long verify_mb = env_long("HERMIT_WORKLOAD_VERIFY_MB", 64, 1, 1 << 20);
	long child_ms = env_long("HERMIT_CHILD_MS", 500, 1, 3600000);
	long max_ticks = env_long("HERMIT_MAX_TICKS", 0, 0, 1L << 40);
	const char *log_path = env_str("HERMIT_TICK_LOG", "/workspace/ticks.log");
	const char *delete_path = env_str("HERMIT_DELETE_PATH", "/etc/hermit-delete-me");
	snprintf(state_dir, sizeof(state_dir), "%s", env_str("HERMIT_STATE_DIR", "/state"));

	struct sigaction sa;
	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_stop; /* no SA_RESTART: poll() returns EINTR */
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
	signal(SIGPIPE, SIG_IGN);

	mkdir_p(state_dir);
	if (write_state("created.txt", "created by pid %d\n", (int)getpid()) < 0)
		die("write created.txt");
	if (*delete_path && unlink(delete_path) < 0)
		out(2, "hermit-stateful: delete %s: %s\n", delete_path, strerror(errno));
	int log_fd = open(log_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
	if (log_fd < 0)
		die(log_path);

	uint64_t *mem = NULL;
	size_t words = (size_t)mem_mb * (1 << 20) / sizeof(uint64_t), verify_at = 0;
	if (words) {
		mem = mmap(NULL, words * sizeof(uint64_t), PROT_READ | PROT_WRITE,
			   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (mem == MAP_FAILED)
			die("mmap");
		for (size_t i = 0; i < words; i++)
			mem[i] = pattern(i);
		out(1, "mem addr=%p mb=%ld\n", (void *)mem, mem_mb);
	}

	int pfd[2];
	if (pipe2(pfd, O_CLOEXEC) < 0)
		die("pipe");
	pid_t parent = getpid(), child = fork();
	if (child < 0)
		die("fork");
	if (child == 0) {
		close(pfd[0]);
		close(log_fd);
		child_main(pfd[1], parent, child_ms);
	}
	close(pfd[1]);
	int lfd = listen_tcp(env_str("HERMIT_LISTEN_ADDR", "0.0.0.0"), port);
	out(1, "hermit-stateful start pid=%d child=%d port=%ld\n", (int)parent, (int)child, port);

	long long counter = 0, child_beats = 0;
	long long next = now_ms() + tick_ms;
	while (!stop_signal) {
		long long now = now_ms();
		if (next - now > tick_ms || now - next > tick_ms)
			next = now + tick_ms; /* clock jumped (restored on another node): resync */
		if (now >= next) {
			counter++;
			next += tick_ms;
			write_state("counter.txt", "%lld\n", counter);
			out(log_fd, "tick %lld\n", counter);
			out(1, "tick %lld\n", counter);
			size_t span = (size_t)verify_mb * (1 << 20) / sizeof(uint64_t);
			for (size_t k = 0; k < span && words; k++, verify_at = (verify_at + 1) % words) {
				if (mem[verify_at] != pattern(verify_at)) {
					out(2, "hermit-stateful: memory corrupted at word %zu (tick %lld)\n",
					    verify_at, counter);
					return EXIT_MEMORY_CORRUPT;
				}
			}
			if (max_ticks && counter >= max_ticks)
				break;
			continue;
		}
		struct pollfd fds[2] = {{lfd, POLLIN, 0}, {pfd[0], POLLIN, 0}};
		int n = poll(fds, 2, (int)(next - now));
		if (n < 0 && errno != EINTR)
			die("poll");
		if (n <= 0)
			continue;
		if (fds[0].revents & POLLIN) {
			int c = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
			if (c >= 0) {
				out(c, "counter=%lld child=%d\n", counter, (int)child);
				close(c);
			}
		}
		if (fds[1].revents & (POLLIN | POLLHUP)) {
			char buf[64];
			ssize_t r = read(pfd[0], buf, sizeof(buf));
			if (r == 0) {
				out(2, "hermit-stateful: background child %d is gone (tick %lld)\n",
				    (int)child, counter);
				return EXIT_CHILD_LOST;
			}
			if (r > 0)
				child_beats += r;
		}
	}
	kill(child, SIGTERM);
	waitpid(child, NULL, 0);
	out(1, "hermit-stateful stop counter=%lld child_beats=%lld\n", counter, child_beats);
	return 0;
}
