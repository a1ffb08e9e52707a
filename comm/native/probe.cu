// tilecomm_probe: prints the NVSHMEM header constants that tilecomm.language hard-codes (one
// "NAME VALUE" line each), so tests and GPU images can check them against the Python side.
// Host-only: it needs the headers at build time and nothing (no GPU, no NVSHMEM library) to run.
#include <cstdio>
#include <nvshmem.h>

int main() {
  struct { const char *name; int value; } rows[] = {
      {"SIGNAL_SET", NVSHMEM_SIGNAL_SET}, {"SIGNAL_ADD", NVSHMEM_SIGNAL_ADD}, {"CMP_EQ", NVSHMEM_CMP_EQ},
      {"CMP_NE", NVSHMEM_CMP_NE},         {"CMP_GT", NVSHMEM_CMP_GT},         {"CMP_LE", NVSHMEM_CMP_LE},
      {"CMP_LT", NVSHMEM_CMP_LT},         {"CMP_GE", NVSHMEM_CMP_GE},
  };
  for (auto &r : rows) std::printf("%s %d\n", r.name, r.value);
  std::printf("VERSION %d.%d.%d\n", NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
              NVSHMEM_VENDOR_PATCH_VERSION);
  return 0;
}
