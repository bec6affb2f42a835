/* rtldnext - prints what dlsym(RTLD_NEXT) found from libnexta: "b" is right. */
#include <stdio.h>

int gs_next_probe(void);

int main(void)
{
    int c = gs_next_probe();
    printf("%c\n", c > 0 ? c : '?');
    return 0;
}
