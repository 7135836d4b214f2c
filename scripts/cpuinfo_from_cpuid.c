/* Print the first block of a /proc/cpuinfo for the CPU this runs on, from CPUID: vendor, family, model
 * and the instruction-set flags kvpolicy's BLAS loader decides with, named as Linux names them.
 * Run under qemu-user (qemu-x86_64 -cpu MODEL ./cpuinfo "name") it describes the emulated CPU, which
 * qemu-user's own /proc/cpuinfo (the host's) does not. Used by tests/test_blas_emulated.py and
 * scripts/test_on_emulated_cpu.sh. */
#include <cpuid.h>
#include <stdio.h>
static void flag(const char *name, unsigned reg, int bit) { if ((reg >> bit) & 1) printf(" %s", name); }
int main(int argc, char **argv) {
    unsigned a, b, c, d, vendor[4] = {0};
    __cpuid(0, a, vendor[0], vendor[2], vendor[1]);
    __cpuid(1, a, b, c, d);
    unsigned family = ((a >> 8) & 15) + (((a >> 8) & 15) == 15 ? (a >> 20) & 255 : 0);
    unsigned model = ((a >> 4) & 15) | (((a >> 8) & 15) >= 6 ? ((a >> 16) & 15) << 4 : 0);
    printf("vendor_id\t: %s\ncpu family\t: %u\nmodel\t\t: %u\nmodel name\t: %s\nflags\t\t:",
           (char *)vendor, family, model, argc > 1 ? argv[1] : "?");
    flag("sse", d, 25); flag("sse2", d, 26); flag("pni", c, 0); flag("ssse3", c, 9); flag("fma", c, 12);
    flag("sse4_1", c, 19); flag("sse4_2", c, 20); flag("popcnt", c, 23); flag("avx", c, 28); flag("f16c", c, 29);
    __cpuid_count(7, 0, a, b, c, d);
    flag("bmi1", b, 3); flag("avx2", b, 5); flag("bmi2", b, 8); flag("avx512f", b, 16); flag("avx512dq", b, 17);
    flag("avx512cd", b, 28); flag("avx512bw", b, 30); flag("avx512vl", b, 31);
    __cpuid(0x80000001, a, b, c, d);
    flag("sse4a", c, 6); flag("fma4", c, 16);
    printf("\n");
    return 0;
}
