// MADV_POPULATE_READ / MADV_POPULATE_WRITE (Linux 5.14): fault a range in
// with one call, returning an error where touching it would raise SIGBUS.
// Older C libraries lack the names; the kernel takes the numbers.
#pragma once

#include <sys/mman.h>

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#define MADV_POPULATE_WRITE 23
#endif
