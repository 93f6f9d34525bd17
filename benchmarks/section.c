/*
 * The measured section of a benchmark, marked for callgrind (see
 * benchmarks/instructions.py, --section, and _common.measured_section).
 *
 * section_start() zeroes the counts of every thread; section_stop() writes
 * them to a dump of their own, named "section", and zeroes them again. Outside
 * valgrind, both do nothing.
 */
#include <valgrind/callgrind.h>

void section_start(void) { CALLGRIND_ZERO_STATS; }

void section_stop(void) { CALLGRIND_DUMP_STATS_AT("section"); }
