"""The wheel's version and platform tag, known before the build (a genrule's output
name must be): the repository rule reads PRECIS_VERSION_* from precis.h (the one
source of the version) and the machine from uname."""

def _define(text, name):
    for line in text.splitlines():
        words = [w for w in line.replace("\t", " ").split(" ") if w]
        if len(words) == 3 and words[0] == "#define" and words[1] == name:
            return words[2]
    fail("precis.h has no #define %s" % name)

def _impl(ctx):
    header = ctx.read(ctx.path(ctx.attr.header))  # re-run when precis.h changes
    version = ".".join([_define(header, "PRECIS_VERSION_" + p) for p in ["MAJOR", "MINOR", "PATCH"]])
    machine = ctx.execute(["uname", "-m"]).stdout.strip()
    ctx.file("BUILD", "")
    ctx.file("defs.bzl", 'WHEEL_VERSION = "%s"\nWHEEL_PLATFORM = "%s"\n' % (
        version,
        ctx.attr.platform_prefix + machine,
    ))

precis_wheel_info = repository_rule(
    implementation = _impl,
    attrs = {
        "header": attr.label(allow_single_file = True),
        "platform_prefix": attr.string(),
    },
)
