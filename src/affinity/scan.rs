//! A scanner of JSON text for the few members routing reads from a request
//! body: it finds where values begin and end (strings skipped with memchr,
//! brackets counted) without decoding or allocating, where a parser would
//! build every value of a prompt that can run to megabytes. It checks the
//! structure it walks (brackets, strings, separators, and the literals and
//! numbers it meets) but not inside strings it does not decode: a body it
//! accepts can still be refused by the backend, never the other way round.
//! Nothing here panics on any input.

use memchr::memchr2;

/// The raw elements of a JSON array `raw` (valid JSON, as serde has read
/// it); `None` when `raw` is not an array.
pub fn elements(raw: &[u8]) -> Option<Vec<&[u8]>> {
    let mut out = Vec::new();
    each_element(raw, |e, _| {
        out.push(e);
        true
    })?;
    Some(out)
}

/// Call `f` with each element of the JSON array `raw` and the offset just
/// past it, while `f` says go on. `None` when `raw` is not an array.
pub fn each_element<'a>(raw: &'a [u8], mut f: impl FnMut(&'a [u8], usize) -> bool) -> Option<()> {
    let mut i = skip_ws(raw, 0);
    if raw.get(i) != Some(&b'[') {
        return None;
    }
    i = skip_ws(raw, i + 1);
    while i < raw.len() && raw[i] != b']' {
        let end = skip_value(raw, i)?;
        if !f(&raw[i..end], end) {
            return Some(());
        }
        i = skip_ws(raw, end);
        match raw.get(i) {
            Some(b',') => i = skip_ws(raw, i + 1),
            Some(b']') => {}
            _ => return None,
        }
    }
    Some(())
}

/// The raw content of the string member `key` of the JSON object `obj`
/// (top level only; escapes left as they are).
pub fn string_field<'a>(obj: &'a [u8], key: &[u8]) -> Option<&'a [u8]> {
    let mut found = None;
    each_member(obj, |name, value| {
        if name != key {
            return true;
        }
        found = match value {
            [b'"', inner @ .., b'"'] => Some(inner),
            _ => None,
        };
        false
    })?;
    found
}

/// Call `f` with each member of the JSON object `obj` (its key as written,
/// its raw value), while `f` says go on. Returns the index just past the
/// object when every member was read, `Some(0)` when `f` stopped early, and
/// `None` when `obj` is not an object.
pub fn each_member<'a>(
    obj: &'a [u8],
    mut f: impl FnMut(&'a [u8], &'a [u8]) -> bool,
) -> Option<usize> {
    each_member_with(obj, |name, at| {
        let end = skip_value(obj, at)?;
        Some((f(name, &obj[at..end]), end))
    })
}

/// Like [`each_member`], with `f` given each member's key and where its
/// value begins, and walking the value itself: it returns whether to go on
/// and where the value ends (`None`: the value is not JSON).
pub fn each_member_with<'a>(
    obj: &'a [u8],
    mut f: impl FnMut(&'a [u8], usize) -> Option<(bool, usize)>,
) -> Option<usize> {
    let mut i = skip_ws(obj, 0);
    if obj.get(i) != Some(&b'{') {
        return None;
    }
    i = skip_ws(obj, i + 1);
    if obj.get(i) == Some(&b'}') {
        return Some(i + 1);
    }
    loop {
        if obj.get(i) != Some(&b'"') {
            return None;
        }
        let key_end = skip_string(obj, i)?;
        let name = &obj[i + 1..key_end - 1];
        i = skip_ws(obj, key_end);
        if obj.get(i) != Some(&b':') {
            return None;
        }
        i = skip_ws(obj, i + 1);
        let (go_on, end) = f(name, i)?;
        if !go_on {
            return Some(0);
        }
        i = skip_ws(obj, end);
        match obj.get(i) {
            Some(b',') => i = skip_ws(obj, i + 1),
            Some(b'}') => return Some(i + 1),
            _ => return None,
        }
    }
}

/// The JSON array at `b[at..]`, walked element by element: where it ends,
/// with where each element ends pushed to `ends` (offsets from `at`).
pub fn array_ends(b: &[u8], at: usize, ends: &mut Vec<usize>) -> Option<usize> {
    let raw = b.get(at..)?;
    let mut end = None;
    let mut i = skip_ws(raw, 0);
    if raw.get(i) != Some(&b'[') {
        return None;
    }
    i = skip_ws(raw, i + 1);
    while i < raw.len() && raw[i] != b']' {
        let e = skip_value(raw, i)?;
        ends.push(e);
        i = skip_ws(raw, e);
        match raw.get(i) {
            Some(b',') => i = skip_ws(raw, i + 1),
            Some(b']') => {}
            _ => return None,
        }
    }
    if raw.get(i) == Some(&b']') {
        end = Some(at + i + 1);
    }
    end
}

pub fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && matches!(b[i], b' ' | b'\n' | b'\r' | b'\t') {
        i += 1;
    }
    i
}

/// `b[i]` opens a string: the index just past its closing quote.
pub fn skip_string(b: &[u8], mut i: usize) -> Option<usize> {
    i += 1;
    loop {
        let j = i + memchr2(b'"', b'\\', b.get(i..)?)?;
        if b[j] == b'\\' {
            i = j + 2;
        } else {
            return Some(j + 1);
        }
    }
}

/// The index just past the JSON value that starts at `b[i]`.
pub fn skip_value(b: &[u8], i: usize) -> Option<usize> {
    match *b.get(i)? {
        b'"' => skip_string(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            while j < b.len() {
                match b[j] {
                    b'"' => {
                        j = skip_string(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            None
        }
        _ => {
            let mut j = i;
            while j < b.len() && !matches!(b[j], b',' | b']' | b'}' | b' ' | b'\n' | b'\r' | b'\t')
            {
                j += 1;
            }
            let token = &b[i..j];
            let number = matches!(token.first(), Some(b'-' | b'0'..=b'9'))
                && token
                    .iter()
                    .all(|c| matches!(c, b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E'));
            (number || matches!(token, b"true" | b"false" | b"null")).then_some(j)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scanner_splits_arrays_and_finds_fields_through_strings_and_nesting() {
        let raw = br#" [ {"content":"a \"role\": \"user\" ]}","role":"assistant"} , {"x":[1,{"role":"y"}],"role" : "user"}, 3, "s\\", null ] "#;
        let els = elements(raw).unwrap();
        assert_eq!(els.len(), 5);
        assert_eq!(string_field(els[0], b"role"), Some(&b"assistant"[..]));
        assert_eq!(string_field(els[1], b"role"), Some(&b"user"[..]));
        assert_eq!(string_field(els[2], b"role"), None);
        assert_eq!(els[3], br#""s\\""#);
        assert!(elements(b"{}").is_none());
        assert_eq!(elements(b"[]").unwrap().len(), 0);
    }

    #[test]
    fn scalars_must_be_json_literals_or_numbers() {
        assert_eq!(skip_value(b"true,", 0), Some(4));
        assert_eq!(skip_value(b"-1.5e3]", 0), Some(6));
        assert_eq!(skip_value(b"null}", 0), Some(4));
        assert_eq!(skip_value(b"tru,", 0), None);
        assert_eq!(skip_value(b"hello", 0), None);
        assert_eq!(skip_value(b"[1, 2", 0), None, "unclosed");
        assert_eq!(skip_value(b"\"open", 0), None, "unclosed");
    }
}
