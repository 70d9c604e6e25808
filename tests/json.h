/* json.h - a strict little JSON reader for the tests (checks dpar's trace files). Parses a whole
   document into a tree of nodes; jv_parse returns NULL on any syntax error. */
#ifndef DPAR_TEST_JSON_H
#define DPAR_TEST_JSON_H
#include <ctype.h>
#include <stdlib.h>
#include <string.h>

typedef enum { JV_NULL, JV_BOOL, JV_NUM, JV_STR, JV_ARR, JV_OBJ } jv_type;
typedef struct jv {
    jv_type type;
    double num;
    char *str;        /* JV_STR value */
    char *key;        /* member name inside an object */
    struct jv *child; /* first element / member */
    struct jv *next;  /* next sibling */
} jv;

typedef struct {
    const char *p;
    int err;
} jv_parser;

static void jv_ws(jv_parser *ps)
{
    while (*ps->p && isspace((unsigned char)*ps->p)) ps->p++;
}

static char *jv_string(jv_parser *ps)
{
    const char *s = ++ps->p;
    char *out, *o;
    size_t n = 0;
    while (*ps->p && *ps->p != '"') {
        if ((unsigned char)*ps->p < 0x20) {
            ps->err = 1;
            return NULL;
        }
        if (*ps->p == '\\') ps->p++;
        if (!*ps->p) {
            ps->err = 1;
            return NULL;
        }
        ps->p++;
        n++;
    }
    if (*ps->p != '"') {
        ps->err = 1;
        return NULL;
    }
    out = o = (char *)malloc(n + 1);
    while (s < ps->p) {
        if (*s == '\\') {
            s++;
            switch (*s) {
            case 'n': *o++ = '\n'; break;
            case 't': *o++ = '\t'; break;
            case 'u':
                *o++ = '?';
                s += 4;
                break;
            case '"':
            case '\\':
            case '/': *o++ = *s; break;
            case 'b':
            case 'f':
            case 'r': *o++ = ' '; break;
            default: ps->err = 1; break;
            }
            s++;
        } else {
            *o++ = *s++;
        }
    }
    *o = 0;
    ps->p++;
    return out;
}

static jv *jv_value(jv_parser *ps, int depth)
{
    jv *v;
    if (depth > 64) {
        ps->err = 1;
        return NULL;
    }
    jv_ws(ps);
    v = (jv *)calloc(1, sizeof *v);
    if (*ps->p == '{' || *ps->p == '[') {
        char close = *ps->p == '{' ? '}' : ']';
        jv **tail = &v->child;
        v->type = close == '}' ? JV_OBJ : JV_ARR;
        ps->p++;
        jv_ws(ps);
        if (*ps->p == close) {
            ps->p++;
            return v;
        }
        for (;;) {
            char *key = NULL;
            jv *c;
            jv_ws(ps);
            if (v->type == JV_OBJ) {
                if (*ps->p != '"') {
                    ps->err = 1;
                    return v;
                }
                key = jv_string(ps);
                if (ps->err) {
                    free(key);
                    return v;
                }
                jv_ws(ps);
                if (*ps->p++ != ':') {
                    free(key);
                    ps->err = 1;
                    return v;
                }
            }
            c = jv_value(ps, depth + 1);
            if (c) c->key = key;
            else free(key);
            *tail = c;
            if (!c || ps->err) return v;
            tail = &c->next;
            jv_ws(ps);
            if (*ps->p == ',') {
                ps->p++;
                continue;
            }
            if (*ps->p == close) {
                ps->p++;
                return v;
            }
            ps->err = 1;
            return v;
        }
    }
    if (*ps->p == '"') {
        v->type = JV_STR;
        v->str = jv_string(ps);
        return v;
    }
    if (!strncmp(ps->p, "true", 4)) {
        v->type = JV_BOOL;
        v->num = 1;
        ps->p += 4;
        return v;
    }
    if (!strncmp(ps->p, "false", 5)) {
        v->type = JV_BOOL;
        ps->p += 5;
        return v;
    }
    if (!strncmp(ps->p, "null", 4)) {
        v->type = JV_NULL;
        ps->p += 4;
        return v;
    }
    {
        char *end;
        v->type = JV_NUM;
        v->num = strtod(ps->p, &end);
        if (end == ps->p) ps->err = 1;
        ps->p = end;
    }
    return v;
}

static void jv_free(jv *v)
{
    while (v) {
        jv *n = v->next;
        jv_free(v->child);
        free(v->str);
        free(v->key);
        free(v);
        v = n;
    }
}

static jv *jv_parse(const char *text)
{
    jv_parser ps;
    jv *v;
    ps.p = text;
    ps.err = 0;
    v = jv_value(&ps, 0);
    jv_ws(&ps);
    if (ps.err || *ps.p) {
        jv_free(v);
        return NULL;
    }
    return v;
}

/* Member `key` of an object, or NULL. */
static jv *jv_get(const jv *obj, const char *key)
{
    jv *c;
    if (!obj || obj->type != JV_OBJ) return NULL;
    for (c = obj->child; c; c = c->next)
        if (c->key && !strcmp(c->key, key)) return c;
    return NULL;
}
#endif
