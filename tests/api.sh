#!/usr/bin/env bash
# tests/api.sh - docs/api.md covers the public API (issue 20): every public function, type, macro, option,
# enum constant (status codes included) of dpar.h and dpar_cuda.h and every environment variable they read has
# an entry in docs/api.md, under the heading of its section, and every name docs/api.md shows no longer
# missing from the headers (no stale entries).
#
#   tests/api.sh          check: print each missing, misplaced or stale name and exit 1; else `api ok: ...`
#   tests/api.sh --list   print what the headers declare, one `kind name file section line` per line
#
# What counts as public (docs/api.md states the same rule at its top):
#   - the public part of a header is what lies between its include guard's `#ifndef X_H_INCLUDED` and the
#     matching `#endif /* X_H_INCLUDED */`; the implementation (under DPAR_IMPLEMENTATION or
#     DPAR_CUDA_IMPLEMENTATION) follows it;
#   - a public name begins with dpar_ or DPAR_ and has no double underscore anywhere (dpar__x, DPAR__X and
#     dpar_cuda__x are internal);
#   - functions: `DPAR_API ... name(` (and the C++ `inline ... name(` overloads) in the public part, however
#     many lines the declaration spans; types: typedef names (function pointer typedefs too) and struct or
#     enum tags; enum constants: the items of every enum, and the X(...) rows of a `*_LIST(X)` macro (the
#     status codes); macros: every #define of the public part; options: every name that a header tests with
#     #ifdef / #ifndef / defined(), in either part, minus the include guards; environment variables: every
#     "DPAR_..." string passed to getenv. Declarations inside #ifdef DPAR_MPI and the like count too.
# In docs/api.md an entry is a table row whose first cell has the name in backticks; `## dpar.h` and
# `## dpar_cuda.h` headings name the header, `### >>tag ...` headings its section (a `###` heading that does not
# begin with a tag: the part of the header before its first section banner); options sit under `## Options`, environment
# variables under `## Environment`. Stale: a backticked dpar_/DPAR_ name (without a double underscore)
# anywhere in docs/api.md that the headers do not have. Undeclared: a function or struct/enum tag with a public name
# that only an implementation part defines (host or device code).
# Needs python3 (without it: prints `skipped: python3 is not installed` and exits 0).
set -u
cd "$(dirname "$0")/.." || exit 2
mode=check
case "${1:-}" in
    "") ;;
    --list) mode=list ;;
    -h | --help) sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "usage: tests/api.sh [--list]" >&2; exit 2 ;;
esac
if ! command -v python3 >/dev/null; then echo "skipped: python3 is not installed"; exit 0; fi
exec python3 - "$mode" dpar.h dpar_cuda.h docs/api.md <<'PY'
import re, sys

mode, headers, doc = sys.argv[1], sys.argv[2:-1], sys.argv[-1]
PUBLIC = re.compile(r'^(?:dpar|DPAR)_\w+$')


def public(name):
    return bool(PUBLIC.match(name)) and '__' not in name


def blank_comments(text):
    """Comments and the insides of string and character literals become spaces (newlines kept, so line numbers
    stay)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith('/*', i):
            j = text.find('*/', i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r'[^\n]', ' ', text[i:j]))
            i = j
        elif text.startswith('//', i):
            j = text.find('\n', i)
            j = n if j < 0 else j
            out.append(' ' * (j - i))
            i = j
        elif c == '"' or c == "'":
            j = i + 1
            while j < n and text[j] != c and text[j] != '\n':
                j += 2 if text[j] == '\\' else 1
            j = min(j + 1, n)
            out.append(c + ' ' * (j - i - 2) + c if j - i >= 2 else text[i:j])
            i = j
        else:
            out.append(c)
            i += 1
    return ''.join(out)


def line_of(text, pos):
    return text.count('\n', 0, pos) + 1


names = {}  # name -> (kind, file, section, line)
undeclared = []  # (name, kind, file, line) defined in an implementation part


def add(name, kind, path, section, line):
    if not public(name):
        return
    if name in names:
        old = names[name]
        # an option stays an option; otherwise the first declaration wins
        if kind == 'option' and old[0] in ('macro',):
            names[name] = ('option',) + old[1:]
        return
    names[name] = (kind, path, section, line)


for path in headers:
    raw = open(path).read()
    code = blank_comments(raw)
    lines = raw.split('\n')
    # the public part: the include guard
    guard = re.search(r'^#ifndef (\w+_H_INCLUDED)\b', raw, re.M)
    if not guard:
        print('FAIL: %s: no include guard `#ifndef X_H_INCLUDED` (the public part cannot be found)' % path)
        sys.exit(1)
    end = re.search(r'^#endif /\* %s \*/' % guard.group(1), raw, re.M)
    if not end:
        print('FAIL: %s: no `#endif /* %s */` (the public part cannot be found)' % (path, guard.group(1)))
        sys.exit(1)
    pub0, pub1 = guard.start(), end.end()
    # the section of a line: the last banner `/* >>tag` (a comment at the start of a line) above it, counted from
    # the include guard on ('': the part before the first banner; a note above the guard does not count)
    section_at, sec, guard_line = [], '', line_of(raw, pub0)
    for k, ln in enumerate(lines, 1):
        if k == guard_line:
            sec = ''
        m = re.match(r'^/\* >>([a-z_]+)', ln)
        if m:
            sec = m.group(1)
        section_at.append(sec)

    def section(line):
        return section_at[line - 1]

    pub = code[pub0:pub1]
    base = line_of(code, pub0) - 1
    # preprocessor lines, continuations joined, in both parts
    for m in re.finditer(r'^[ \t]*#[ \t]*(\w+)((?:[^\n]*\\\n)*[^\n]*)', code, re.M):
        directive, rest = m.group(1), m.group(2)
        line = line_of(code, m.start())
        in_pub = pub0 <= m.start() < pub1
        if directive in ('ifdef', 'ifndef', 'if', 'elif'):
            if directive in ('if', 'elif'):
                tested = re.findall(r'\b((?:DPAR|dpar)_\w+)', rest)
            else:
                tested = re.findall(r'^\s*(\w+)', rest)
            for t in tested:
                if t.endswith('_H_INCLUDED'):
                    continue
                add(t, 'option', path, section(line) if in_pub else 'impl', line)
        elif directive == 'define':
            dm = re.match(r'\s+(\w+)(\(([^)]*)\))?', rest)
            if not dm:
                continue
            name = dm.group(1)
            if in_pub or public(name):
                add(name, 'macro', path, section(line) if in_pub else 'impl', line)
            if in_pub and name.endswith('_LIST') and dm.group(3) and dm.group(3).strip() == 'X':
                for x in re.finditer(r'\bX\s*\(\s*(\w+)\s*,', rest):
                    add(x.group(1), 'enum constant', path, section(line), line + rest.count('\n', 0, x.start()))
    # the public part with preprocessor lines blanked, for the declarations
    decl = re.sub(r'^[ \t]*#(?:[^\n]*\\\n)*[^\n]*', lambda m: re.sub(r'[^\n]', ' ', m.group(0)), pub, flags=re.M)
    # functions: DPAR_API ... name(   and the C++ inline overloads
    for m in re.finditer(r'\b(?:DPAR_API|inline)\b[^;{}()]*?\b(\w+)\s*\(', decl):
        line = base + line_of(decl, m.start(1))
        add(m.group(1), 'function', path, section(line), line)
    # typedefs at any depth outside function bodies: from `typedef` to the `;` at the same brace depth
    for m in re.finditer(r'\btypedef\b', decl):
        i, depth = m.end(), 0
        while i < len(decl):
            ch = decl[i]
            if ch == '{':
                depth += 1
            elif ch == '}':
                depth -= 1
            elif ch == ';' and depth == 0:
                break
            i += 1
        stmt = decl[m.end():i]
        flat = stmt
        while True:  # drop the bodies
            new = re.sub(r'\{[^{}]*\}', ' ', flat)
            if new == flat:
                break
            flat = new
        fp = re.search(r'\(\s*\*\s*(\w+)\s*\)', flat)
        if fp:
            name = fp.group(1)
        else:
            ids = re.findall(r'\b([A-Za-z_]\w*)\b', re.sub(r'\[[^\]]*\]', ' ', flat))
            name = ids[-1] if ids else ''
        line = base + line_of(decl, m.start())
        add(name, 'type', path, section(line), line)
    # struct and enum tags
    for m in re.finditer(r'\b(?:struct|enum)\s+(\w+)', decl):
        line = base + line_of(decl, m.start(1))
        add(m.group(1), 'type', path, section(line), line)
    # enum constants: the items of every enum body
    for m in re.finditer(r'\benum\b\s*\w*\s*\{([^}]*)\}', decl):
        body_line = base + line_of(decl, m.start(1))
        for item in m.group(1).split(','):
            im = re.match(r'\s*(\w+)', item)
            if im:
                line = body_line + m.group(1).count('\n', 0, m.group(1).find(item))
                add(im.group(1), 'enum constant', path, section(line), line)
    # the implementation (host and device parts): a function or a struct/enum tag with a public name that the
    # public part does not declare is public all the same (dpar__ is the internal spelling): remembered here,
    # reported below. Definitions begin at the start of a line; statements inside functions are indented.
    impl = code[pub1:]
    impl_base = line_of(code, pub1) - 1
    for m in re.finditer(r'^(?![ \t#])(?!return\b)[^;=\n(]*?\b(\w+)\s*\(', impl, re.M):
        undeclared.append((m.group(1), 'function', path, impl_base + line_of(impl, m.start(1))))
    for m in re.finditer(r'\b(?:struct|enum)\s+(\w+)', impl):
        undeclared.append((m.group(1), 'type', path, impl_base + line_of(impl, m.start(1))))
    # environment variables: "DPAR_..." passed to a getenv, in either part
    for m in re.finditer(r'\bgetenv\w*\s*\(\s*"(DPAR_\w+)"', raw):
        add(m.group(1), 'environment variable', path, 'env', line_of(raw, m.start()))

# options and environment variables live under their own headings of api.md
expected = {}
for name, (kind, path, sec, line) in names.items():
    if kind == 'option':
        expected[name] = ('options', '')
    elif kind == 'environment variable':
        expected[name] = ('environment', '')
    else:
        expected[name] = (path, sec)

if mode == 'list':
    for name, (kind, path, sec, line) in sorted(names.items(), key=lambda kv: (kv[1][1], kv[1][3], kv[0])):
        print('%-20s %-40s %-12s %-10s %d' % (kind.replace(' ', '_'), name, path, sec or '-', line))
    sys.exit(0)

try:
    text = open(doc).read()
except OSError as e:
    print('FAIL: %s cannot be read (%s)' % (doc, e.strerror))
    sys.exit(1)
entries = {}  # name -> [(file, section, line)]
where = ('', '')
for n, ln in enumerate(text.split('\n'), 1):
    h2 = re.match(r'^## (.*)', ln)
    h3 = re.match(r'^### (.*)', ln)
    if h2:
        t = h2.group(1)
        if t.startswith('Options'):
            where = ('options', '')
        elif t.startswith('Environment'):
            where = ('environment', '')
        else:
            hm = re.match(r'`?(\w+\.h)`?', t)
            where = (hm.group(1) if hm else t, '')
    elif h3:
        tm = re.match(r'>>([a-z_]+)', h3.group(1))
        where = (where[0], tm.group(1) if tm else '')
    elif ln.startswith('|'):
        cells = ln.split('|')
        if len(cells) > 2:
            for nm in re.findall(r'`((?:dpar|DPAR)_\w+)', cells[1]):
                entries.setdefault(nm, []).append((where[0], where[1], n))

bad = 0
counts = {}
for name, (kind, path, sec, line) in sorted(names.items(), key=lambda kv: (kv[1][1], kv[1][3])):
    counts[kind] = counts.get(kind, 0) + 1
    want = expected[name]
    label = {'options': 'under ## Options', 'environment': 'under ## Environment'}.get(
        want[0], 'under ## %s, ### %s' % (want[0], ('>>' + want[1]) if want[1] else '(the part before the first section)'))
    if name not in entries:
        print('FAIL: missing: %s `%s` (%s:%d) has no entry in %s (a table row, %s)' % (kind, name, path, line, doc, label))
        bad += 1
    elif want not in [(f, s) for f, s, _ in entries[name]]:
        got = entries[name][0]
        print('FAIL: misplaced: %s `%s` (%s:%d) has its entry at %s:%d, under ## %s, ### %s; want it %s' %
              (kind, name, path, line, doc, got[2], got[0], ('>>' + got[1]) if got[1] else '(no tag)', label))
        bad += 1
seen = set()
for name, kind, path, line in undeclared:
    if public(name) and name not in names and name not in seen:
        seen.add(name)
        print('FAIL: undeclared: %s `%s` (%s:%d) is defined in the implementation with a public name, but the public '
              'part does not declare it: declare it (and give it its entry here) or name it dpar__' % (kind, name, path, line))
        bad += 1
for n, ln in enumerate(text.split('\n'), 1):
    for nm in re.findall(r'`((?:dpar|DPAR)_\w+)', ln):
        if public(nm) and nm not in names:
            print('FAIL: stale: %s:%d names `%s`, which dpar.h and dpar_cuda.h do not declare' % (doc, n, nm))
            bad += 1
order = ['function', 'type', 'macro', 'option', 'enum constant', 'environment variable']
summary = ', '.join('%d %ss' % (counts.get(k, 0), k) for k in order)
if bad:
    print('api: %d problem%s (%s in the headers)' % (bad, '' if bad == 1 else 's', summary))
    sys.exit(1)
print('api ok: %s, each with its entry in %s' % (summary, doc))
PY
