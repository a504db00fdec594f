// Reads float arguments (hex, one per line), prints k mod 4 and r of brrr_reduce_large: the
// device range reduction compiled for the host, checked by test_trig_reduce.py.
#include <cstdio>
#include <cstdlib>
#include "trig_reduce.h"
int main() {
    float x; 
    while (scanf("%a", &x) == 1) { int q; double r = brrr_reduce_large(x, &q); printf("%d %.17g\n", ((q % 4) + 4) % 4, r); }
}
