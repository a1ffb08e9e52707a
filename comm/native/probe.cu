// tilecomm_probe: prints the NVSHMEM header constants that tilecomm.language hard-codes, so an
// image whose NVSHMEM disagrees is caught before a kernel misbehaves. Exit code 1 on a mismatch.
#include <cstdio>
#include <nvshmem.h>

int main() {
  struct { const char *name; int header, tilecomm; } rows[] = {
      {"NVSHMEM_SIGNAL_SET", NVSHMEM_SIGNAL_SET, 9}, {"NVSHMEM_SIGNAL_ADD", NVSHMEM_SIGNAL_ADD, 10},
      {"NVSHMEM_CMP_EQ", NVSHMEM_CMP_EQ, 0},         {"NVSHMEM_CMP_NE", NVSHMEM_CMP_NE, 1},
      {"NVSHMEM_CMP_GT", NVSHMEM_CMP_GT, 2},         {"NVSHMEM_CMP_LE", NVSHMEM_CMP_LE, 3},
      {"NVSHMEM_CMP_LT", NVSHMEM_CMP_LT, 4},         {"NVSHMEM_CMP_GE", NVSHMEM_CMP_GE, 5},
  };
  int bad = 0;
  for (auto &r : rows) {
    std::printf("%-20s header %3d  tilecomm %3d  %s\n", r.name, r.header, r.tilecomm, r.header == r.tilecomm ? "ok" : "MISMATCH");
    bad |= r.header != r.tilecomm;
  }
  std::printf("NVSHMEM %d.%d.%d\n", NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION, NVSHMEM_VENDOR_PATCH_VERSION);
  return bad;
}
