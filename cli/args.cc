#include "args.h"

#include <cmath>
#include <exception>
#include <ostream>
#include <utility>

#include "common.h"

namespace m3msa::cli {

namespace {

std::string subcommand_list(const std::vector<Command>& commands) {
  std::string out;
  for (std::size_t i = 0; i < commands.size(); ++i) {
    if (i > 0) out += i + 1 == commands.size() ? " or " : ", ";
    out += commands[i].app->get_name();
  }
  return out;
}

}  // namespace

CommandLine::CommandLine()
    : app(std::make_unique<CLI::App>(
          "m3msa: MiniMax-M3 sparse attention (MSA) decode. The lightning indexer's block "
          "scoring, exact top-k block selection and block-sparse GQA attention, on the CPU "
          "reference (and CUDA when built with it).",
          "m3msa")) {
  app->option_defaults()->always_capture_default();
  app->set_version_flag("--version", std::string("m3msa ") + version_string());
  app->require_subcommand(1);
  app->footer(
      "Run `m3msa SUBCOMMAND --help` for the flags of a subcommand.\n"
      "Exit codes: 0 ok, 1 a correctness check failed, 2 bad flags or values, 3 an error from "
      "the library (the message names the argument).\n"
      "Environment: none is read.");
  commands.push_back(add_demo_command(*app));
  commands.push_back(add_info_command(*app));
  commands.push_back(add_replay_command(*app));
  commands.push_back(add_bench_command(*app));
  commands.push_back(add_launch_command(*app));
  commands.push_back(add_soak_command(*app));
}

CommandLineError::CommandLineError(std::string where, const std::string& message, std::string hint)
    : Error(ErrorCode::kInvalidArgument, message),
      where_(std::move(where)),
      hint_(std::move(hint)) {}

ParsedCommandLine parse_command_line(CommandLine& line, int argc, const char* const* argv) {
  CLI::App& app = *line.app;
  ParsedCommandLine parsed;
  auto print_with = [&app](auto error) {
    return
        [&app, error](std::ostream& out, std::ostream& err) { return app.exit(error, out, err); };
  };
  // Where the parse stopped: the deepest subcommand CLI11 had entered.
  auto where = [&line]() {
    std::string at = "m3msa";
    for (const Command& c : line.commands) {
      if (c.app->parsed()) at += " " + c.app->get_name();
    }
    return at;
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    parsed.print = print_with(e);
    return parsed;
  } catch (const CLI::CallForAllHelp& e) {
    parsed.print = print_with(e);
    return parsed;
  } catch (const CLI::CallForVersion& e) {
    parsed.print = print_with(e);
    return parsed;
  } catch (const CLI::ExtrasError& e) {
    // CLI11 lists what it did not expect unquoted, so an empty or blank argument would be
    // invisible in the message: quote each one.
    const std::string at = where();
    const std::vector<std::string> extras = app.remaining(true);
    std::string listed;
    for (const std::string& extra : extras) {
      listed += (listed.empty() ? "'" : ", '") + extra + "'";
      // CLI11 splits a cluster of short flags ("-q0" -> -q, then "-0"): name what was typed.
      bool typed = false;
      for (int i = 1; i < argc && !typed; ++i) typed = extra == argv[i];
      for (int i = 1; i < argc && !typed && extra.size() >= 2 && extra[0] == '-'; ++i) {
        const std::string arg = argv[i];
        if (arg.size() > extra.size() && arg[0] == '-' && arg[1] != '-' &&
            arg.compare(arg.size() - (extra.size() - 1), extra.size() - 1, extra, 1) == 0) {
          listed += " (in '" + arg + "')";
          typed = true;
        }
      }
    }
    if (listed.empty()) listed = e.what();
    throw CommandLineError(
        at,
        std::string(extras.size() == 1 ? "unexpected argument " : "unexpected arguments ") + listed,
        "Run `" + at + " --help` for the flags and their defaults.");
  } catch (const CLI::ParseError& e) {
    const std::string at = where();
    if (std::string(e.what()).rfind("A subcommand is required", 0) == 0 && argc > 1) {
      // No subcommand was selected (options in its place, or "--" before it): show what came.
      std::string got;
      for (int i = 1; i < argc && i <= 8; ++i)
        got += std::string(i > 1 ? " '" : "'") + argv[i] + "'";
      if (argc > 9) got += " ...";
      throw CommandLineError(
          "m3msa", "a subcommand is required (" + subcommand_list(line.commands) + "); got " + got,
          "Run `m3msa --help` for the subcommands.");
    }
    if (at == "m3msa") {
      // Nothing below the top level was entered: say which subcommands exist.
      if (argc > 1 && argv[1][0] != '-') {
        throw CommandLineError(at,
                               std::string("unknown subcommand '") + argv[1] + "' (expected " +
                                   subcommand_list(line.commands) + ")",
                               "Run `m3msa --help` for the subcommands.");
      }
      if (argc <= 1) {
        throw CommandLineError(at,
                               "a subcommand is required (" + subcommand_list(line.commands) + ")",
                               "Run `m3msa --help` for the subcommands.");
      }
    }
    throw CommandLineError(at, e.what(),
                           "Run `" + at + " --help` for the flags and their defaults.");
  } catch (const Error& e) {
    // A validator of ours threw (its message names the flag): keep the one error type.
    const std::string at = where();
    throw CommandLineError(at, e.message(),
                           "Run `" + at + " --help` for the flags and their defaults.");
  } catch (const std::exception& e) {
    // CLI11 converts values with the standard library, which may throw on its own; the command
    // line is still what is wrong.
    const std::string at = where();
    throw CommandLineError(at, std::string("cannot parse the command line: ") + e.what(),
                           "Run `" + at + " --help` for the flags and their defaults.");
  }
  for (const Command& c : line.commands) {
    if (c.app->parsed()) {
      // CLI11 reads "nan" and "inf" as numbers and its Range validator lets NaN through (every
      // comparison with NaN is false): no flag of ours means anything with a non-finite value.
      for (const CLI::Option* opt : c.app->get_options()) {
        if (opt->count() == 0 || opt->get_type_name().rfind("FLOAT", 0) != 0) continue;
        double value = 0;
        const bool finite =
            CLI::detail::lexical_cast(opt->results().back(), value) && std::isfinite(value);
        if (!finite) {
          const std::string at = "m3msa " + c.app->get_name();
          throw CommandLineError(
              at, opt->get_name() + ": " + opt->results().back() + " is not a finite number",
              "Run `" + at + " --help` for the flags and their defaults.");
        }
      }
      parsed.command = &c;
      parsed.where = "m3msa " + c.app->get_name();
      return parsed;
    }
  }
  // require_subcommand(1) makes this unreachable; keep the contract anyway.
  throw CommandLineError("m3msa",
                         "a subcommand is required (" + subcommand_list(line.commands) + ")",
                         "Run `m3msa --help` for the subcommands.");
}

}  // namespace m3msa::cli
