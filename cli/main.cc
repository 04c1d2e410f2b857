// m3msa: the command-line tool (demo, info, replay, bench).
#include <cstdio>

int main() {
  std::puts("m3msa");
  return 0;
}
