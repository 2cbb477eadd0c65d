/*
 * seccomp_exec RULES -- COMMAND [ARG...]
 * seccomp_exec --names        (prints "NR NAME" for every syscall of the native arch)
 *
 * Installs a seccomp filter built with libseccomp from RULES, then execs COMMAND under it.
 * scripts/criu_capabilities.py writes RULES from a Docker/OCI-style JSON profile
 * (scripts/seccomp/default-like.json) resolved for one capability set, and compiles this file
 * at run time: cc -O2 -o seccomp_exec seccomp_exec.c -lseccomp   (Debian: libseccomp-dev).
 *
 * RULES is plain text, one directive a line, fields separated by spaces:
 *   default errno N | default log | default allow
 *   arch x86 | arch x32                  (the native arch is always in the filter)
 *   allow NAME
 *   errno NAME N
 *   allow NAME ARG_INDEX eq VALUE
 *   allow NAME ARG_INDEX masked_eq MASK VALUE
 * Names the running libseccomp does not know are skipped (counted on stderr with -v).
 *
 * Installing a filter without no_new_privs needs CAP_SYS_ADMIN: run this with full root
 * capabilities, before dropping them (capsh does that after it, under the filter), the order
 * a container runtime uses.
 */
#include <errno.h>
#include <seccomp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void die(const char *what, int rc)
{
	fprintf(stderr, "seccomp_exec: %s: %s\n", what, strerror(rc < 0 ? -rc : rc));
	exit(126);
}

int main(int argc, char **argv)
{
	if (argc == 2 && !strcmp(argv[1], "--names")) {
		for (int nr = 0; nr < 1024; nr++) {
			char *name = seccomp_syscall_resolve_num_arch(SCMP_ARCH_NATIVE, nr);
			if (name) {
				printf("%d %s\n", nr, name);
				free(name);
			}
		}
		return 0;
	}
	if (argc < 4 || strcmp(argv[2], "--") != 0) {
		fprintf(stderr, "usage: seccomp_exec RULES -- COMMAND [ARG...]\n");
		return 2;
	}
	FILE *rules = fopen(argv[1], "r");
	if (!rules)
		die(argv[1], errno);

	char line[512];
	scmp_filter_ctx ctx = NULL;
	int skipped = 0, added = 0, rc;
	int verbose = getenv("SECCOMP_EXEC_VERBOSE") != NULL;

	while (fgets(line, sizeof(line), rules)) {
		char verb[32], name[64], op[32];
		unsigned long long a = 0, b = 0;
		unsigned int idx = 0;
		int n;

		line[strcspn(line, "\n")] = '\0';
		if (line[0] == '\0' || line[0] == '#')
			continue;
		n = sscanf(line, "%31s %63s %u %31s %lli %lli", verb, name, &idx, op, &a, &b);
		if (n < 2) {
			fprintf(stderr, "seccomp_exec: bad line: %s\n", line);
			return 2;
		}
		if (!strcmp(verb, "default")) {
			uint32_t act;
			if (ctx) {
				fprintf(stderr, "seccomp_exec: 'default' must come first\n");
				return 2;
			}
			if (!strcmp(name, "log"))
				act = SCMP_ACT_LOG;
			else if (!strcmp(name, "allow"))
				act = SCMP_ACT_ALLOW;
			else if (!strcmp(name, "errno") && sscanf(line, "%*s %*s %u", &idx) == 1)
				act = SCMP_ACT_ERRNO(idx);
			else {
				fprintf(stderr, "seccomp_exec: bad default: %s\n", line);
				return 2;
			}
			ctx = seccomp_init(act);
			if (!ctx)
				die("seccomp_init", ENOMEM);
			continue;
		}
		if (!ctx) {
			fprintf(stderr, "seccomp_exec: the first directive must be 'default'\n");
			return 2;
		}
		if (!strcmp(verb, "arch")) {
			uint32_t arch = seccomp_arch_resolve_name(name);
			if (!arch)
				die(name, EINVAL);
			rc = seccomp_arch_add(ctx, arch);
			if (rc && rc != -EEXIST)
				die("seccomp_arch_add", rc);
			continue;
		}

		int nr = seccomp_syscall_resolve_name(name);
		if (nr == __NR_SCMP_ERROR) {
			skipped++;
			if (verbose)
				fprintf(stderr, "seccomp_exec: unknown syscall %s skipped\n", name);
			continue;
		}
		if (!strcmp(verb, "errno")) {
			unsigned int err;
			if (sscanf(line, "%*s %*s %u", &err) != 1) {
				fprintf(stderr, "seccomp_exec: bad errno rule: %s\n", line);
				return 2;
			}
			rc = seccomp_rule_add(ctx, SCMP_ACT_ERRNO(err), nr, 0);
		} else if (!strcmp(verb, "allow") && n == 2) {
			rc = seccomp_rule_add(ctx, SCMP_ACT_ALLOW, nr, 0);
		} else if (!strcmp(verb, "allow") && n == 5 && !strcmp(op, "eq")) {
			rc = seccomp_rule_add(ctx, SCMP_ACT_ALLOW, nr, 1, SCMP_CMP(idx, SCMP_CMP_EQ, a));
		} else if (!strcmp(verb, "allow") && n == 6 && !strcmp(op, "masked_eq")) {
			rc = seccomp_rule_add(ctx, SCMP_ACT_ALLOW, nr, 1, SCMP_CMP(idx, SCMP_CMP_MASKED_EQ, a, b));
		} else {
			fprintf(stderr, "seccomp_exec: bad rule: %s\n", line);
			return 2;
		}
		if (rc) {
			/* e.g. a syscall that exists on none of the filter's arches */
			skipped++;
			if (verbose)
				fprintf(stderr, "seccomp_exec: rule '%s' skipped: %s\n", line, strerror(-rc));
			continue;
		}
		added++;
	}
	fclose(rules);
	if (!ctx) {
		fprintf(stderr, "seccomp_exec: no rules\n");
		return 2;
	}
	if (verbose)
		fprintf(stderr, "seccomp_exec: %d rules, %d skipped\n", added, skipped);
	/* No no_new_privs: the caller has CAP_SYS_ADMIN, as a container runtime has. */
	rc = seccomp_attr_set(ctx, SCMP_FLTATR_CTL_NNP, 0);
	if (rc)
		die("seccomp_attr_set(NNP)", rc);
	rc = seccomp_load(ctx);
	if (rc)
		die("seccomp_load", rc);
	seccomp_release(ctx);
	execvp(argv[3], argv + 3);
	die(argv[3], errno);
	return 126;
}
