/*
 * Helpers the test programs share. Every block is written and read through
 * these, and they are opaque to the optimiser, so no allocation can be
 * removed or turned into another one. `checksum` is printed by the
 * programs, so their output depends on every byte they wrote.
 */
#ifndef ALLOCTRAMP_TESTBINS_COMMON_H
#define ALLOCTRAMP_TESTBINS_COMMON_H

#include <stddef.h>

__attribute__((unused)) static unsigned long checksum;

__attribute__((noinline, noclone, noipa, unused)) static void fill(void *p, size_t n, unsigned seed)
{
    unsigned char *c = p;
    for (size_t i = 0; i < n; i++)
        c[i] = (unsigned char)(seed + i * 31u + 1u);
}

__attribute__((noinline, noclone, noipa, unused)) static void sum(const void *p, size_t n)
{
    const unsigned char *c = p;
    for (size_t i = 0; i < n; i++)
        checksum = checksum * 131u + c[i];
}

#endif
