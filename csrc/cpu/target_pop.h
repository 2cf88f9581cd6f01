// The last line of an instruction set's unit (product_avx2.cpp, product_avx512.cpp): pops the
// target its first lines pushed. Included once per unit, so no include guard.
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
