/* A stand-in for bcryptprimitives.dll, which Rust's std (1.78+) imports for ProcessPrng and which
 * Wine before 9.0 (Debian bookworm ships 8.0) lacks. tests/windows/run.sh builds it with MinGW into
 * its throwaway WINEPREFIX only when that Wine has no bcryptprimitives.dll of its own.
 * ProcessPrng is forwarded to RtlGenRandom (advapi32!SystemFunction036), which Wine has. */
#include <windows.h>

BOOLEAN WINAPI SystemFunction036(PVOID buffer, ULONG len);

__declspec(dllexport) BOOL WINAPI ProcessPrng(PBYTE data, SIZE_T len) {
    while (len > 0) {
        ULONG chunk = len > 0x10000000 ? 0x10000000 : (ULONG)len;
        if (!SystemFunction036(data, chunk)) {
            return FALSE;
        }
        data += chunk;
        len -= chunk;
    }
    return TRUE;
}
