/*
 * hermit-bench-holder: the memory of an agent sandbox in the turn benchmark (bench/turns.py).
 *
 *   hermit-bench-holder <MiB> <report path>
 *
 * Holds <MiB> of patterned anonymous memory (each 4 KiB page: 512 bytes derived from its
 * index, the rest zero, so it compresses about as well as a real heap) and sleeps in
 * pause(): between turns it does not run, so the turn inspector sees it idle. On SIGUSR1
 * it checks every page and writes "ok <MiB>" or "bad <page>" to <report path>.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define PAGE 4096
#define FILLED 512

static volatile sig_atomic_t check_requested;

static void on_usr1(int sig) { (void)sig; check_requested = 1; }

static uint64_t word(uint64_t page, uint64_t i) {
	uint64_t x = page * 0x9E3779B97F4A7C15ULL + i * 0xBF58476D1CE4E5B9ULL + 1;
	x ^= x >> 31; x *= 0x94D049BB133111EBULL; x ^= x >> 29;
	return x;
}

static void fill(uint64_t *mem, size_t pages) {
	for (size_t p = 0; p < pages; p++) {
		uint64_t *w = mem + p * (PAGE / 8);
		for (size_t i = 0; i < FILLED / 8; i++) w[i] = word(p, i);
	}
}

static long verify(const uint64_t *mem, size_t pages) {
	for (size_t p = 0; p < pages; p++) {
		const uint64_t *w = mem + p * (PAGE / 8);
		for (size_t i = 0; i < PAGE / 8; i++)
			if (w[i] != (i < FILLED / 8 ? word(p, i) : 0)) return (long)p;
	}
	return -1;
}

int main(int argc, char **argv) {
	if (argc != 3) {
		fprintf(stderr, "usage: %s <MiB> <report path>\n", argv[0]);
		return 2;
	}
	size_t mib = strtoul(argv[1], NULL, 10), pages = mib * 256;
	uint64_t *mem = mmap(NULL, pages * PAGE, PROT_READ | PROT_WRITE,
	                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (mem == MAP_FAILED) { perror("mmap"); return 1; }
	fill(mem, pages);
	signal(SIGUSR1, on_usr1);
	fprintf(stderr, "holding %zu MiB\n", mib);
	for (;;) {
		pause();
		if (!check_requested) continue;
		check_requested = 0;
		long bad = verify(mem, pages);
		FILE *f = fopen(argv[2], "w");
		if (!f) continue;
		if (bad < 0) fprintf(f, "ok %zu\n", mib); else fprintf(f, "bad %ld\n", bad);
		fclose(f);
	}
}
