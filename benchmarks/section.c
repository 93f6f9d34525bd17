/*
 * The measured section of a benchmark, marked for callgrind (see
 * benchmarks/instructions.py, --section, and _common.measured_section).
 *
 * section_start() zeroes the counts; section_stop() writes them to a dump of
 * their own, labelled "section", and zeroes them again. Callgrind applies both
 * to the calling thread's counts; with --separate-threads=no (its default,
 * which instructions.py passes), the counts of all threads are pooled, so the
 * section counts every thread of the process. Outside valgrind, both do
 * nothing.
 */
#include <valgrind/callgrind.h>

void section_start(void) { CALLGRIND_ZERO_STATS; }

void section_stop(void) { CALLGRIND_DUMP_STATS_AT("section"); }
