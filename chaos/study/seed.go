package study

// SeedRow is one row of the seed study's published tables
// (../shared/seeds/study-zh.txt, sections 4 and 5): two vLLM replicas of
// Qwen3.8-27B-FP8 on one L20 each, AIBrix v0.7.0 with a history index, one
// gateway, 96 arrivals at 1.6 RPS per phase.
type SeedRow struct {
	Scenario string
	Round    int
	Strategy string
	TTFTP95  float64 // seconds
	TPOTP95  float64 // milliseconds
	HitRate  float64 // fraction
	SLOPass  int     // of 96
	A, B     int     // requests per replica
}

// SeedTable is the published table, in its order.
var SeedTable = []SeedRow{
	{ScenarioCold, 1, "random", 7.689, 90.8, 0.777, 40, 45, 51},
	{ScenarioCold, 1, "least-request", 7.673, 106.1, 0.777, 43, 48, 48},
	{ScenarioCold, 1, "prefix-cache", 5.575, 81.4, 0.854, 59, 36, 60},
	{ScenarioCold, 2, "random", 9.229, 73.3, 0.780, 28, 47, 49},
	{ScenarioCold, 2, "least-request", 6.422, 84.5, 0.777, 48, 47, 49},
	{ScenarioCold, 2, "prefix-cache", 9.049, 66.1, 0.854, 40, 60, 36},
	{ScenarioWarm, 1, "random", 0.625, 59.8, 0.931, 96, 46, 50},
	{ScenarioWarm, 1, "least-request", 0.325, 58.5, 0.932, 96, 46, 50},
	{ScenarioWarm, 1, "prefix-cache", 0.325, 59.3, 0.931, 96, 48, 48},
	{ScenarioWarm, 2, "random", 1.975, 60.0, 0.932, 91, 54, 42},
	{ScenarioWarm, 2, "least-request", 0.327, 58.5, 0.932, 96, 50, 46},
	{ScenarioWarm, 2, "prefix-cache", 9.692, 60.4, 0.931, 43, 70, 26},
	{ScenarioHot50, 1, "random", 2.844, 82.4, 0.853, 78, 52, 44},
	{ScenarioHot50, 1, "least-request", 1.767, 71.6, 0.854, 96, 48, 48},
	{ScenarioHot50, 1, "prefix-cache", 8.317, 59.8, 0.933, 38, 27, 69},
	{ScenarioHot50, 2, "random", 5.990, 81.7, 0.854, 63, 39, 57},
	{ScenarioHot50, 2, "least-request", 1.907, 81.9, 0.854, 94, 47, 49},
	{ScenarioHot50, 2, "prefix-cache", 8.279, 59.9, 0.931, 37, 27, 69},
	{ScenarioHot90, 1, "random", 5.578, 71.5, 0.873, 76, 42, 54},
	{ScenarioHot90, 1, "least-request", 1.771, 70.3, 0.874, 96, 47, 49},
	{ScenarioHot90, 1, "prefix-cache", 6.535, 59.9, 0.922, 68, 38, 58},
	{ScenarioHot90, 2, "random", 3.547, 70.8, 0.883, 78, 53, 43},
	{ScenarioHot90, 2, "least-request", 1.255, 82.2, 0.882, 96, 48, 48},
	{ScenarioHot90, 2, "prefix-cache", 8.001, 59.8, 0.924, 61, 38, 58},
}

// SeedFor returns the published row for a scenario, round and strategy.
func SeedFor(scenario string, round int, strategy string) (SeedRow, bool) {
	for _, r := range SeedTable {
		if r.Scenario == scenario && r.Round == round && r.Strategy == strategy {
			return r, true
		}
	}
	return SeedRow{}, false
}
