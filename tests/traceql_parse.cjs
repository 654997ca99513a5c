// Parse TraceQL queries with Grafana's own grammar (@grafana/lezer-traceql).
// Usage: node tests/traceql_parse.cjs GRAMMAR_DIR < queries.json
// Prints [{query, errors: [offsets of error nodes]}] as JSON.
const path = require("path");
const { parser } = require(path.join(process.argv[2], "node_modules", "@grafana", "lezer-traceql"));
const queries = JSON.parse(require("fs").readFileSync(0, "utf8"));
const results = queries.map((query) => {
  const errors = [];
  parser.parse(query).iterate({
    enter: (node) => {
      if (node.type.isError) errors.push(node.from);
    },
  });
  return { query, errors };
});
process.stdout.write(JSON.stringify(results));
