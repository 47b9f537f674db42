//! XXH3-64 (unseeded, default secret) of a prompt block, computed with AVX2
//! where the processor has it, chosen at run time.
//!
//! `xxhash_rust` picks its vector width when it is compiled, so a binary
//! built for the x86-64 baseline hashes with SSE2 even on a processor with
//! AVX2. Hashing is most of what reading a long keyless prompt costs (a
//! 256 KiB prompt is 256 blocks), so inputs past 240 bytes take XXH3's long
//! loop here with 256-bit lanes. The value is XXH3's own, bit for bit: the
//! gateways of a fleet name prompts alike whatever their processors (held by
//! a test against `xxhash_rust` for every length class).

use xxhash_rust::xxh3::xxh3_64;

/// XXH3-64 of `input`, as `xxhash_rust::xxh3::xxh3_64` computes it.
#[inline]
pub fn hash(input: &[u8]) -> u64 {
    #[cfg(all(target_arch = "x86_64", not(target_feature = "avx2")))]
    if input.len() > MID_SIZE_MAX && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the processor has AVX2 (checked just above; std caches it).
        return unsafe { avx2::long(input) };
    }
    xxh3_64(input)
}

const MID_SIZE_MAX: usize = 240;

#[cfg(all(target_arch = "x86_64", not(target_feature = "avx2")))]
mod avx2 {
    use std::arch::x86_64::*;

    const DEFAULT_SECRET_SIZE: usize = 192;
    /// XXH3's default secret (`kSecret` of the reference implementation).
    #[rustfmt::skip]
    const DEFAULT_SECRET: [u8; DEFAULT_SECRET_SIZE] = [
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
];

    const STRIPE: usize = 64;
    const SECRET_RATE: usize = 8;
    const STRIPES_PER_BLOCK: usize = (DEFAULT_SECRET_SIZE - STRIPE) / SECRET_RATE;
    const BLOCK: usize = STRIPE * STRIPES_PER_BLOCK;
    const LAST_ACC_START: usize = 7;
    const MERGE_ACCS_START: usize = 11;

    const P32_1: u64 = 0x9E37_79B1;
    const P32_2: u64 = 0x85EB_CA77;
    const P32_3: u64 = 0xC2B2_AE3D;
    const P64_1: u64 = 0x9E37_79B1_85EB_CA87;
    const P64_2: u64 = 0xC2B2_AE3D_27D4_EB4F;
    const P64_3: u64 = 0x1656_67B1_9E37_79F9;
    const P64_4: u64 = 0x85EB_CA77_C2B2_AE63;
    const P64_5: u64 = 0x27D4_EB2F_1656_67C5;

    /// One stripe of 64 bytes into the accumulators, against `secret`'s
    /// 64 bytes at `key`.
    #[inline(always)]
    unsafe fn accumulate(acc: &mut [__m256i; 2], stripe: *const u8, key: *const u8) {
        for (i, a) in acc.iter_mut().enumerate() {
            let data = _mm256_loadu_si256(stripe.add(32 * i) as *const __m256i);
            let k = _mm256_loadu_si256(key.add(32 * i) as *const __m256i);
            let data_key = _mm256_xor_si256(data, k);
            let product = _mm256_mul_epu32(data_key, _mm256_srli_epi64(data_key, 32));
            // Each 64-bit lane adds its neighbour's input: (1, 0, 3, 2).
            let swapped = _mm256_shuffle_epi32(data, 0b0100_1110);
            *a = _mm256_add_epi64(product, _mm256_add_epi64(*a, swapped));
        }
    }

    #[inline(always)]
    unsafe fn scramble(acc: &mut [__m256i; 2], key: *const u8) {
        let prime = _mm256_set1_epi32(P32_1 as i32);
        for (i, a) in acc.iter_mut().enumerate() {
            let mixed = _mm256_xor_si256(*a, _mm256_srli_epi64(*a, 47));
            let k = _mm256_loadu_si256(key.add(32 * i) as *const __m256i);
            let data_key = _mm256_xor_si256(mixed, k);
            let lo = _mm256_mul_epu32(data_key, prime);
            let hi = _mm256_mul_epu32(_mm256_srli_epi64(data_key, 32), prime);
            *a = _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
        }
    }

    fn read64(bytes: &[u8], at: usize) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&bytes[at..at + 8]);
        u64::from_le_bytes(b)
    }

    fn fold(a: u64, b: u64) -> u64 {
        let p = a as u128 * b as u128;
        (p as u64) ^ ((p >> 64) as u64)
    }

    /// XXH3-64's long path (`input` over 240 bytes).
    #[target_feature(enable = "avx2")]
    pub unsafe fn long(input: &[u8]) -> u64 {
        let len = input.len();
        let secret = DEFAULT_SECRET.as_ptr();
        let start: [u64; 8] = [P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1];
        let mut acc = [
            _mm256_loadu_si256(start.as_ptr() as *const __m256i),
            _mm256_loadu_si256(start.as_ptr().add(4) as *const __m256i),
        ];
        let data = input.as_ptr();
        let blocks = (len - 1) / BLOCK;
        for b in 0..blocks {
            for s in 0..STRIPES_PER_BLOCK {
                accumulate(
                    &mut acc,
                    data.add(b * BLOCK + s * STRIPE),
                    secret.add(s * SECRET_RATE),
                );
            }
            scramble(&mut acc, secret.add(DEFAULT_SECRET_SIZE - STRIPE));
        }
        let stripes = ((len - 1) - BLOCK * blocks) / STRIPE;
        for s in 0..stripes {
            accumulate(
                &mut acc,
                data.add(blocks * BLOCK + s * STRIPE),
                secret.add(s * SECRET_RATE),
            );
        }
        accumulate(
            &mut acc,
            data.add(len - STRIPE),
            secret.add(DEFAULT_SECRET_SIZE - STRIPE - LAST_ACC_START),
        );
        let mut lanes = [0u64; 8];
        _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, acc[0]);
        _mm256_storeu_si256(lanes.as_mut_ptr().add(4) as *mut __m256i, acc[1]);
        let mut h = (len as u64).wrapping_mul(P64_1);
        for i in 0..4 {
            let k = MERGE_ACCS_START + 16 * i;
            h = h.wrapping_add(fold(
                lanes[2 * i] ^ read64(&DEFAULT_SECRET, k),
                lanes[2 * i + 1] ^ read64(&DEFAULT_SECRET, k + 8),
            ));
        }
        h ^= h >> 37;
        h = h.wrapping_mul(0x1656_6791_9E37_79F9);
        h ^ (h >> 32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_value_as_xxhash_rust_at_every_length_class() {
        let data: Vec<u8> = (0..20_016u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        // Short and mid inputs, the long path's edges (one stripe, a block
        // and a byte either side, several blocks and a partial one).
        let mut lengths: Vec<usize> = vec![0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 255, 256];
        lengths.extend([1023, 1024, 1025, 1088, 2047, 2048, 2049, 4096, 5000, 19_999]);
        lengths.extend((241..1500).step_by(7));
        for len in lengths {
            for offset in [0, 1, 5] {
                let input = &data[offset..offset + len];
                assert_eq!(hash(input), xxh3_64(input), "length {len}, offset {offset}");
            }
        }
    }
}
