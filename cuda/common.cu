// Exports shared by every launcher in the library; host_harness.cpp includes this file for the same exports.
#include "common.cuh"

extern "C" const char* dflash_last_error() { return dflash::g_last_error; }

DFLASH_EXPORT_PARAMS_SIZE(index_view, dflash::IndexView)
